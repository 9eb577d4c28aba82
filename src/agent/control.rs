//! The node under a control plane, before anything runs: the enrollment it
//! syncs as, the mesh up from the last peer set (before anything binds on
//! its address or dials control through it), who may call the node API,
//! the cluster registry's credential, and the renewal of the identity.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use tokio::sync::{mpsc, watch};

use super::tasks::Tasks;
use crate::config::Config;
use crate::control::sync::SyncConfig;
use crate::runtime::pull::ClusterRegistryWatch;
use crate::status::Observation;

/// What the wiring needs of the control plane's side.
#[derive(Debug)]
pub(super) struct ControlLink {
    pub sync: SyncConfig,
    /// The executor's status batches, for the sync stream.
    pub batches: mpsc::UnboundedSender<Vec<Observation>>,
    pub batches_rx: mpsc::UnboundedReceiver<Vec<Observation>>,
    /// Pulls from the cluster registry send the node's credential and
    /// trust the cluster CA; a renewal replaces them.
    pub registry: ClusterRegistryWatch,
    /// Who may call the node API: the join's control peers and the
    /// configured ids, then (with the mesh) whatever each peer set says.
    pub controls: crate::node_api::ControlIds,
    pub mesh_ip: Option<Ipv4Addr>,
    /// The renewal's notices, for `status`.
    pub renewal_notices: watch::Receiver<Vec<String>>,
    /// Why nobody may call the node API, if nobody may.
    pub api_notices: watch::Receiver<Vec<String>>,
}

impl ControlLink {
    /// `None` standalone. The mesh task and the renewer join `feeds`.
    pub async fn prepare(
        config: &Config,
        join_addr: Option<&str>,
        device_binary: &Path,
        feeds: &mut Tasks,
    ) -> Result<Option<Self>> {
        let Some(addr) = &config.control else {
            return Ok(None);
        };
        let mut sync = SyncConfig::load(addr, &config.data_dir)
            .with_context(|| format!("--control {addr}: this node has no usable enrollment; run `zattera-agent join --control {addr} --token TOKEN` first"))?;
        if let Some(id) = config.node_id.as_ref().filter(|id| **id != sync.node_id) {
            anyhow::bail!("--node-id {id}: this node enrolled as {}", sync.node_id);
        }
        let enrollment = crate::link::identity::IdentityDir::new(&config.data_dir)
            .load_enrollment()
            .context("the node enrollment")?;
        let (api_tx, api_notices) = watch::channel(Vec::new());
        if let Some(why) = crate::node_api::refuses_everyone(
            &enrollment.control_node_ids,
            &config.control_node_ids,
            enrollment.mesh_enabled,
        ) {
            tracing::warn!("{why}");
            api_tx.send_replace(vec![why]);
        }
        let (controls_tx, controls) = watch::channel(
            sync.control_node_ids
                .iter()
                .chain(&config.control_node_ids)
                .cloned()
                .collect::<BTreeSet<String>>(),
        );
        let tls = Arc::clone(&sync.tls.borrow());
        let (registry_tx, registry) =
            watch::channel(enrollment.cluster_registry(&tls).map(Arc::new));
        let feed = crate::mesh::watch::ControlFeed {
            tx: controls_tx,
            configured: config.control_node_ids.iter().cloned().collect(),
            registry: Some(registry_tx.clone()),
        };
        let link = crate::mesh::start::Link {
            node_id: sync.node_id.clone(),
            control_addr: sync.control_addr.clone(),
            tls: sync.tls.clone(),
        };
        let mut mesh_ip = None;
        if let Some(mesh) = crate::mesh::start::start(
            &config.mesh,
            &crate::layout::Layout::new(&config.data_dir, &config.run_dir),
            &enrollment,
            link,
            device_binary,
            feed,
        )
        .await?
        {
            sync.targets = mesh.targets;
            mesh_ip = Some(mesh.mesh_ip);
            feeds.adopt("mesh", mesh.task);
        }
        let (tls_tx, tls_rx) = watch::channel(tls);
        sync.tls = tls_rx;
        let (notices_tx, renewal_notices) = watch::channel(Vec::new());
        let renewer = crate::control::renew::Renewer {
            join: config.join_token.as_ref().map(|token| {
                crate::control::join::JoinOptions::for_this_node(
                    join_addr.map_or_else(|| enrollment.control_addr.clone(), str::to_owned),
                    token.clone(),
                    config,
                )
            }),
            tls: tls_tx,
            registry: registry_tx,
            notices: notices_tx,
        };
        feeds.spawn("identity renewal", renewer.run());
        let (batches, batches_rx) = mpsc::unbounded_channel();
        Ok(Some(Self {
            sync,
            batches,
            batches_rx,
            registry,
            controls,
            mesh_ip,
            renewal_notices,
            api_notices,
        }))
    }
}
