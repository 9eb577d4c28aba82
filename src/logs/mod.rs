//! Container output: the log shim that writes it ([`shim`]), where it lies
//! on disk ([`files`]) and how long it is kept ([`retention`], with the
//! janitor's sweep), the reference agent's store, read after a move from
//! it ([`reference`]), and queries over all of it ([`query`]).

pub mod files;
pub mod janitor;
pub mod query;
pub mod reference;
pub mod retention;
pub mod shim;

pub use retention::Retention;
