//! zattera-dns: the scoped internal resolver bound on each bridge gateway.
//!
//! Each listener answers only for its own scope (project, environment):
//! `<app>.internal` and `<app>.<env>.<project>.internal`. Every other name is
//! relayed to the host's upstream resolvers. Today this crate holds the name
//! rules ([`name`]); listeners land with the DNS issue.

pub mod name;

pub use name::{InternalName, Scope};
