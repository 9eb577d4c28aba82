//! zattera-agent: a containerd-native node agent.
//!
//! It keeps one machine in sync with a control plane (or with manifest files,
//! standalone), running containers through containerd's gRPC API, with
//! networks from [`zattera_netns`] and internal DNS from [`zattera_dns`].
//! See the README for the architecture.

pub mod admin;
pub mod agent;
pub mod beneath;
pub mod build;
pub mod config;
pub mod control;
pub mod doctor;
pub mod durable;
pub mod executor;
pub mod health;
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
