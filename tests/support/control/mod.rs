//! The one test control plane: a tonic server with its own CA, serving
//! `JoinService`, `AgentSyncService`, `RouteService` and `MeshService`
//! (WatchPeers) the way wire.md describes control's side, and control's
//! build-source endpoint ([`blobs`]). It records what agents send and lets
//! a test push assignment sets, route snapshots and mesh membership, refuse
//! streams, and stop and restart on the same port.
//!
//! [`ControlPlane::start`] serves one control node on loopback, for a
//! cluster without the mesh; [`ControlPlane::mesh`] is the shared state of
//! a mesh whose control hosts (support/mesh_cluster.rs) each serve it with
//! [`ControlPlane::serve_as`] on their own address, one of them the leader.

//!
//! One file per part: [`ca`] (the cluster CA), [`record`] (what control
//! saw), [`plane`] (the services and the handle tests drive),
//! [`node_api`] (calling and serving the node API), [`operations`] (the
//! reference's rollout and build dispatch), [`releases`] (release
//! channels over HTTP), [`assignments`],
//! [`agent`] (the agent binary under this control plane) and
//! [`buildkitd`] (what a test's buildkitd leaves).

#![allow(
    dead_code,
    unused_imports,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::wildcard_imports,
    clippy::disallowed_methods
)]

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures::Stream;
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use zattera_agent::link::tls::{self, ClientAuth, PeerIdentity};
use zattera_agent::proto::cluster::agent_message::Body;
use zattera_agent::proto::cluster::agent_sync_service_server::{
    AgentSyncService, AgentSyncServiceServer,
};
use zattera_agent::proto::cluster::join_service_server::{JoinService, JoinServiceServer};
use zattera_agent::proto::cluster::mesh_service_server::{MeshService, MeshServiceServer};
use zattera_agent::proto::cluster::route_service_server::{RouteService, RouteServiceServer};
use zattera_agent::proto::cluster::{
    AgentMessage, AssignmentSet, ControlMessage, JoinRequest, JoinResponse, Peer, PeerSet,
    PunchCommand, PunchStreamRequest, ReportObservedEndpointRequest,
    ReportObservedEndpointResponse, RequestPunchRequest, RequestPunchResponse, RouteSnapshot,
    WatchPeersRequest, WatchRoutesRequest, control_message,
};
use zattera_agent::proto::v1::AssignmentObserved;

pub mod agent;
pub mod assignments;
#[path = "../blobs.rs"]
pub mod blobs;
pub mod buildkitd;
pub mod ca;
pub mod node_api;
pub mod operations;
pub mod plane;
pub mod record;
pub mod releases;

pub use agent::*;
pub use assignments::*;
pub use buildkitd::*;
pub use ca::*;
pub use node_api::*;
pub use plane::*;
pub use record::*;
pub use releases::*;

/// The node id of the test control plane's own node certificate.
pub const CONTROL_NODE_ID: &str = "control-1";
/// The API port of every control host of a mesh.
pub const MESH_API_PORT: u16 = 8443;
/// The mesh's address range.
pub const MESH_CIDR: &str = "10.90.0.0/16";
