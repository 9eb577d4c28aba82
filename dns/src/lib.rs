//! zattera-dns: the scoped internal resolver bound on each bridge gateway
//! (runtime.md §8, DESIGN.md decision 6).
//!
//! The agent holds one [`DnsServer`] and drives it with two calls:
//!
//! * [`DnsServer::reconcile`] with one [`ListenerSpec`] (gateway address,
//!   [`Scope`]) per network: UDP and TCP listeners on `<gateway>:53` are
//!   opened, moved to a new scope, or closed to match; failed binds come
//!   back as [`ListenerState::Failed`] and are retried at the next call.
//! * [`DnsServer::set_table`] with a [`NameTable`] built from a route
//!   snapshot ([`NameTable::from_routes`], answers are VIPs) or, standalone,
//!   from the healthy local instances ([`NameTable::from_instances`]). The
//!   table is swapped atomically: readers never wait.
//!
//! A listener of scope S answers `<app>.internal` and
//! `<app>.<env>.<project>.internal` from the table when the name belongs to
//! S, NXDOMAIN for any other internal name, and relays every other name to
//! the host's upstream resolvers ([`UpstreamSource`]).
//!
//! Module map, one job each:
//!
//! | module | job |
//! |---|---|
//! | [`name`] | internal name rules and [`Scope`] |
//! | [`table`] | the name table and its inputs |
//! | [`request`] | bytes in, decision out: answer, forward or drop (no I/O) |
//! | `fast` | the common internal A query answered from the wire bytes |
//! | `forward` | raw relay to the upstreams over UDP or TCP |
//! | [`upstream`] | the upstream list from resolv.conf, re-read on change |
//! | `udp`, `tcp` | receive loops (why not hickory-server: see `udp`) |
//! | `listener` | binding one gateway's sockets |
//! | `server` | [`DnsServer`] and reconcile |
//! | `context` | state the receive loops share; the forward slots |
//! | `config`, `error` | [`Config`] (defaults: the spec's numbers); typed errors |
//!
//! Where this departs from the reference resolver (runtime.md §8), on
//! purpose:
//!
//! * Scope is (project id, environment **name**), the recommended D-7
//!   reading; the environment name of a route comes from its FQDN.
//! * Failed binds are retried at every reconcile, sockets bind with
//!   `IP_FREEBIND` by default, and a gateway whose scope changes is moved to
//!   the new scope in place.
//! * Upstreams follow resolv.conf changes, and systemd-resolved's real list
//!   replaces a stub-only file (D-5); host-local upstreams are kept, our own
//!   listeners never used. TCP queries are relayed over TCP (D-4 uses UDP),
//!   so big answers arrive whole.
//! * A SERVFAIL we make for a forwarded name carries RA and not AA: we are
//!   not the authority for it. Internal answers are AA without RA (D-2).
//! * Over UDP, answers are capped at 1232 bytes (or 512 without EDNS) and
//!   sent truncated beyond that; EDNS versions above 0 get BADVERS.

mod config;
mod context;
mod error;
mod fast;
mod forward;
mod listener;
mod mmsg;
pub mod name;
pub mod request;
mod server;
pub mod stats;
pub mod table;
mod tcp;
mod udp;
pub mod upstream;

pub use config::Config;
pub use error::{BindError, Error};
pub use name::{InternalName, NameClass, Scope};
pub use server::{DnsServer, ListenerSpec, ListenerState, ListenerStatus};
pub use stats::StatsSnapshot;
pub use table::{LocalInstance, NameTable, RouteService};
pub use upstream::UpstreamSource;
