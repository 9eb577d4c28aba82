//! Calling and serving the node API in tests.

use super::*;

/// A spawned task, aborted when this is dropped.
pub struct AbortOnDrop(pub tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Node API proxy targets: loopback only, with an empty status.
pub fn loopback_targets() -> zattera_agent::node_api::proxy::Targets {
    zattera_agent::node_api::proxy::Targets {
        host_ips: vec!["127.0.0.1".parse().unwrap()],
        status: watch::channel(Arc::new(zattera_agent::status::StatusSnapshot::default())).1,
    }
}

/// A node context for node `node_id` on `ctd` with its state in `data`:
/// loopback targets, no stats, no upgrade source and no builder.
pub fn node_context(
    ctd: &zattera_agent::runtime::Containerd,
    data: &std::path::Path,
    node_id: &str,
    desired: watch::Receiver<Option<AssignmentSet>>,
) -> zattera_agent::node_api::NodeContext {
    zattera_agent::node_api::NodeContext {
        ctd: ctd.clone(),
        desired,
        targets: loopback_targets(),
        data_dir: data.to_owned(),
        run_dir: data.join("run"),
        node_id: node_id.into(),
        stats: None,
        upgrade: zattera_agent::upgrade::UpgradeConfig {
            base_url: None,
            binary: data.join("bin/zattera-agent"),
            args: Vec::new(),
            busy: Arc::default(),
            stats: None,
        },
        builder: Err(zattera_agent::image_build::NoBuilder::Off),
    }
}

/// Serves the node API as `node` (with `ctx`, if any) on a loopback port,
/// trusting [`CONTROL_NODE_ID`] as control; returns its address and task.
pub async fn serve_node_api(
    node: &tls::NodeTls,
    ctx: Option<zattera_agent::node_api::NodeContext>,
) -> (String, AbortOnDrop) {
    let api = zattera_agent::node_api::NodeApi::bind(
        "127.0.0.1:0".parse().unwrap(),
        node,
        ctx,
        zattera_agent::node_api::control_ids([CONTROL_NODE_ID]),
    )
    .await
    .unwrap();
    let addr = api.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let _ = api.serve().await;
    });
    (addr, AbortOnDrop(task))
}

/// A node API client for node `node_id` at `addr`, presenting `client`.
pub async fn node_api_client(
    addr: &str,
    node_id: &str,
    client: rustls::ClientConfig,
) -> zattera_agent::proto::cluster::agent_local_service_client::AgentLocalServiceClient<
    tonic::transport::Channel,
> {
    let name = rustls::pki_types::ServerName::try_from(format!("node-{node_id}")).unwrap();
    zattera_agent::proto::cluster::agent_local_service_client::AgentLocalServiceClient::new(
        tls::connect_as(addr, name, client).await.unwrap(),
    )
}

/// A free loopback `host:port` (bound, then released).
pub async fn free_loopback_addr() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    addr
}
