//! The operations an operator runs through the reference control plane,
//! played as its code does them (zattera-dev/zattera): the upgrade rollout
//! of `zt cluster upgrade` (`internal/cli/clusterupgrade.go`) and the build
//! dispatcher (`internal/daemon/scheduler/builds.go`).

use super::*;

use zattera_agent::proto::cluster::agent_local_service_client::AgentLocalServiceClient;
use zattera_agent::proto::cluster::{AgentUpgradeRequest, BuildEvent, RunBuildRequest};

/// The node API of one node, as control dials it.
pub type NodeApi = AgentLocalServiceClient<tonic::transport::Channel>;

/// How long the rollout waits for a node to report the new version
/// (`nodeUpgradeTimeout`).
pub const NODE_UPGRADE_TIMEOUT: Duration = Duration::from_secs(300);

/// `zt cluster upgrade VERSION --yes` over `nodes`, in order: per node,
/// cordon; UpgradeNode (its error ignored: "connection dropped while it
/// restarted"); wait until the node's record reports exactly `version`
/// (from its hello); uncordon. The first node that does not report it
/// within `timeout` aborts the rollout, left cordoned, the rest untouched.
pub async fn upgrade_rollout(
    cp: &ControlPlane,
    nodes: &mut [(String, NodeApi)],
    version: &str,
    url: &str,
    sha256: &str,
    timeout: Duration,
) -> Result<(), String> {
    let total = nodes.len();
    for (i, (node, api)) in nodes.iter_mut().enumerate() {
        cp.set_schedulable(node, false);
        let sent = api
            .upgrade_binary(AgentUpgradeRequest {
                version: version.into(),
                url: url.into(),
                sha256: sha256.into(),
            })
            .await;
        if let Err(e) = sent {
            eprintln!(
                "  connection dropped while {node} restarted ({e}); waiting for it to come back"
            );
        }
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let record = cp.node_record(node).unwrap_or_default();
            let alive = cp.with(|r| r.session_host_of(node).is_some());
            if record.binary_version == version && alive {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(format!(
                    "node {node} failed: did not report {version} within {timeout:?}: still on {} \
                     (the remaining {} node(s) were not touched; {node} is left cordoned)",
                    record.binary_version,
                    total - i - 1
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        cp.set_schedulable(node, true);
    }
    Ok(())
}

/// The dispatcher's choice (`pickBuilder`): a node labelled `builder=true`,
/// schedulable and connected; the first by id (no builds run elsewhere).
/// `None`: the build stays queued ("no schedulable builder node").
pub fn pick_builder(cp: &ControlPlane, candidates: &[String]) -> Option<String> {
    let mut ok: Vec<&String> = candidates
        .iter()
        .filter(|n| {
            cp.node_record(n).is_some_and(|r| {
                r.schedulable && r.labels.get("builder").is_some_and(|v| v == "true")
            }) && cp.with(|r| r.session_host_of(n).is_some())
        })
        .collect();
    ok.sort();
    ok.first().map(|n| (*n).clone())
}

/// Dispatches `req` as the reference does: RunBuild on the picked node,
/// every event read to the end; a refusal is FAILED "build stream: ...",
/// never retried.
pub async fn dispatch_build(
    api: &mut NodeApi,
    req: RunBuildRequest,
) -> Result<Vec<BuildEvent>, String> {
    let mut stream = api
        .run_build(req)
        .await
        .map_err(|e| format!("build stream: {e}"))?
        .into_inner();
    let mut events = Vec::new();
    loop {
        match stream.message().await {
            Ok(Some(e)) => events.push(e),
            Ok(None) => return Ok(events),
            Err(e) => return Err(format!("build stream: {e}")),
        }
    }
}
