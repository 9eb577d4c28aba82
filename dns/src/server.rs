//! The handle the agent holds: listeners by gateway, the name table, and
//! the upstream watcher.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::config::Config;
use crate::context::{ListenerCtx, Shared};
use crate::error::{BindError, Error};
use crate::listener::Listener;
use crate::name::Scope;
use crate::table::NameTable;
use crate::upstream::Upstreams;

/// One wanted listener: a gateway address and the scope it answers for
/// (N-6: the gateway of each assignment's subnet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerSpec {
    pub addr: IpAddr,
    pub scope: Scope,
}

/// The outcome of a reconcile for one wanted listener.
#[derive(Debug)]
pub struct ListenerStatus {
    pub addr: IpAddr,
    pub scope: Scope,
    pub state: ListenerState,
}

#[derive(Debug)]
pub enum ListenerState {
    /// Bound on UDP and TCP and answering.
    Serving,
    /// Not bound; tried again at the next reconcile.
    Failed(BindError),
}

impl ListenerStatus {
    pub fn is_serving(&self) -> bool {
        matches!(self.state, ListenerState::Serving)
    }
}

/// The node's resolver: one listener per gateway, one name table and one
/// upstream list shared by all of them.
#[derive(Debug)]
pub struct DnsServer {
    shared: Arc<Shared>,
    listeners: Mutex<Listeners>,
    watcher: JoinHandle<()>,
}

/// Open listeners, and the last bind error of each gateway that failed, so
/// a failure repeating every reconcile is logged once, not every 3 s.
#[derive(Debug, Default)]
struct Listeners {
    open: HashMap<IpAddr, Listener>,
    failing: HashMap<IpAddr, String>,
}

impl DnsServer {
    /// Reads the upstream list and starts watching it. Must be called inside
    /// a tokio runtime; no listener is open until [`Self::reconcile`].
    pub fn new(config: Config) -> Result<Self, Error> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| Error::NoRuntime)?;
        let upstreams = Arc::new(Upstreams::new(config.upstreams.clone()));
        let watcher = runtime.spawn(Arc::clone(&upstreams).watch(config.upstream_poll));
        Ok(Self {
            shared: Arc::new(Shared::new(config, upstreams)),
            listeners: Mutex::new(Listeners::default()),
            watcher,
        })
    }

    /// Makes the open listeners match `desired`: opens the missing ones
    /// (retrying those that failed before), moves a listener whose gateway
    /// changed scope to the new scope in place, and closes the ones no
    /// longer wanted. Duplicate addresses: the last one wins (N-6).
    /// Returns one status per distinct wanted address, failures included.
    pub async fn reconcile(&self, desired: Vec<ListenerSpec>) -> Vec<ListenerStatus> {
        let mut wanted: Vec<ListenerSpec> = Vec::with_capacity(desired.len());
        for spec in desired {
            match wanted.iter_mut().find(|w| w.addr == spec.addr) {
                Some(w) => *w = spec,
                None => wanted.push(spec),
            }
        }
        let mut guard = self.listeners.lock().await;
        let Listeners {
            open: listeners,
            failing,
        } = &mut *guard;
        failing.retain(|addr, _| wanted.iter().any(|w| w.addr == *addr));
        let gone: Vec<IpAddr> = listeners
            .keys()
            .filter(|addr| !wanted.iter().any(|w| w.addr == **addr))
            .copied()
            .collect();
        for addr in gone {
            if let Some(listener) = listeners.remove(&addr) {
                listener.close().await;
                info!(gateway = %addr, "dns listener closed");
            }
        }
        let mut statuses = Vec::with_capacity(wanted.len());
        for spec in wanted {
            let scope = spec.scope.normalized();
            let state = if let Some(listener) = listeners.get(&spec.addr) {
                if **listener.ctx.scope.load() != scope {
                    info!(gateway = %spec.addr, project = %scope.project,
                          environment = %scope.environment, "dns listener moved to a new scope");
                    listener.ctx.scope.store(Arc::new(scope));
                }
                ListenerState::Serving
            } else {
                match self.open(spec.addr, scope) {
                    Ok(listener) => {
                        failing.remove(&spec.addr);
                        info!(gateway = %spec.addr, project = %spec.scope.project,
                              environment = %spec.scope.environment, "dns listener open");
                        listeners.insert(spec.addr, listener);
                        ListenerState::Serving
                    }
                    Err(e) => {
                        let message = e.to_string();
                        if failing.get(&spec.addr) == Some(&message) {
                            debug!(gateway = %spec.addr, error = %e, "dns listener still not open");
                        } else {
                            warn!(gateway = %spec.addr, error = %e, "dns listener not open; retried at every reconcile");
                            failing.insert(spec.addr, message);
                        }
                        ListenerState::Failed(e)
                    }
                }
            };
            statuses.push(ListenerStatus {
                addr: spec.addr,
                scope: spec.scope,
                state,
            });
        }
        self.shared
            .own
            .store(Arc::new(listeners.keys().copied().collect()));
        statuses
    }

    fn open(&self, addr: IpAddr, scope: Scope) -> Result<Listener, BindError> {
        let ctx = Arc::new(ListenerCtx::new(scope, Arc::clone(&self.shared)));
        let config = &self.shared.config;
        Listener::open(
            SocketAddr::new(addr, config.port),
            config.udp_sockets,
            config.freebind,
            ctx,
        )
    }

    /// Replaces the name table. Queries already being answered finish with
    /// the old table; every query after this call sees the new one.
    pub fn set_table(&self, table: NameTable) {
        self.shared.table.store(Arc::new(table));
    }

    /// The current name table.
    pub fn table(&self) -> Arc<NameTable> {
        self.shared.table.load_full()
    }

    /// What the server was asked and how it answered, since it started.
    pub fn stats(&self) -> crate::stats::StatsSnapshot {
        self.shared.stats.snapshot()
    }

    /// The upstream resolvers in use right now.
    pub fn upstreams(&self) -> Vec<SocketAddr> {
        self.shared.upstreams.get().to_vec()
    }

    /// The gateways with an open listener.
    pub async fn serving(&self) -> Vec<IpAddr> {
        self.listeners.lock().await.open.keys().copied().collect()
    }

    /// Closes every listener and stops watching the upstream list.
    pub async fn shutdown(self) {
        self.watcher.abort();
        let listeners: Vec<Listener> = self
            .listeners
            .lock()
            .await
            .open
            .drain()
            .map(|(_, l)| l)
            .collect();
        for listener in listeners {
            listener.close().await;
        }
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        // Listeners abort their tasks when dropped (JoinSet); the watcher
        // is a plain task and needs telling.
        self.watcher.abort();
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::upstream::UpstreamSource;

    fn config() -> Config {
        Config {
            upstreams: UpstreamSource::Fixed(vec![]),
            ..Config::default()
        }
    }

    #[test]
    fn the_server_can_be_shared_and_driven_from_spawned_tasks() {
        fn send_sync<T: Send + Sync>() {}
        fn send<T: Send>(_: &T) {}
        send_sync::<DnsServer>();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let server = DnsServer::new(config()).unwrap();
            let reconcile = server.reconcile(vec![]);
            send(&reconcile);
            assert!(reconcile.await.is_empty());
            assert!(server.table().is_empty());
            server.shutdown().await;
        });
    }

    #[test]
    fn creating_a_server_outside_a_runtime_is_an_error() {
        assert!(matches!(DnsServer::new(config()), Err(Error::NoRuntime)));
    }
}
