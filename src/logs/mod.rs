//! Container output: the log shim that writes it ([`shim`]), where it lies
//! on disk ([`files`]) and how long it is kept ([`retention`], with the
//! janitor's sweep).

pub mod files;
pub mod janitor;
pub mod retention;
pub mod shim;

pub use retention::Retention;
