//! zattera-agent: a containerd-native node agent.
//!
//! It keeps one machine in sync with a control plane (or with manifest files,
//! standalone), running containers through containerd's gRPC API, with
//! networks from [`zattera_netns`] and internal DNS from [`zattera_dns`].
//! See the README for the architecture.
//!
//! The modules stand on floors; a module imports from its own floor and the
//! floors below, never above (`tests/layers.rs` holds this table for every
//! module, nested ones included, and finds no cycle):
//!
//! | floor | modules |
//! |---|---|
//! | shared words | `proto` `status` `labels` `link` `beneath` `programs` `redact` `version` `durable` `layout` `addr_scope` |
//! | operations | `runtime` `logs` `volumes` `upgrade` `image_build` `snapshot` `mesh` `health` `metrics` `telemetry` `image_gc` |
//! | executor and sources | `executor` `source` `control` `config` |
//! | doors | `node_api` `admin` `doctor` |
//! | wiring | `agent`, and the binaries (`cli`, `bin`) |

pub mod addr_scope;
pub mod admin;
pub mod agent;
pub mod beneath;
pub mod config;
pub mod control;
pub mod doctor;
pub mod durable;
pub mod executor;
pub mod health;
pub mod image_build;
pub mod image_gc;
pub mod labels;
pub mod layout;
pub mod link;
pub mod logs;
pub mod mesh;
pub mod metrics;
pub mod node_api;
pub mod programs;
pub mod proto;
pub mod redact;
pub mod runtime;
pub mod snapshot;
pub mod source;
pub mod status;
pub mod telemetry;
pub mod upgrade;
pub mod version;
pub mod volumes;
