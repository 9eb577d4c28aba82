//! State shared by the receive loops: the name table, the upstreams and
//! the limits, plus each listener's scope.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::Config;
use crate::forward;
use crate::name::Scope;
use crate::request::{Request, Transport};
use crate::table::NameTable;
use crate::upstream::Upstreams;

/// One per server.
#[derive(Debug)]
pub(crate) struct Shared {
    /// Swapped whole; readers take a snapshot without locking.
    pub(crate) table: ArcSwap<NameTable>,
    pub(crate) upstreams: Arc<Upstreams>,
    /// Our own listening addresses, never used as upstreams: a resolv.conf
    /// naming a gateway would otherwise make every query chase its tail.
    pub(crate) own: ArcSwap<Vec<IpAddr>>,
    forwards: Arc<Semaphore>,
    pub(crate) config: Config,
    pub(crate) stats: crate::stats::Stats,
}

impl Shared {
    pub(crate) fn new(config: Config, upstreams: Arc<Upstreams>) -> Self {
        Self {
            table: ArcSwap::from_pointee(NameTable::empty()),
            upstreams,
            own: ArcSwap::from_pointee(Vec::new()),
            // Semaphore::new panics past MAX_PERMITS; no config may do that.
            forwards: Arc::new(Semaphore::new(
                config.max_forwards.min(Semaphore::MAX_PERMITS),
            )),
            config,
            stats: crate::stats::Stats::default(),
        }
    }

    /// The upstream list less our own listeners.
    fn usable_upstreams(&self) -> Vec<SocketAddr> {
        let own = self.own.load();
        let port = self.config.port;
        self.upstreams
            .get()
            .iter()
            .filter(|u| !(u.port() == port && own.contains(&u.ip())))
            .copied()
            .collect()
    }

    /// A server-wide slot for one forwarded query (see
    /// [`ListenerCtx::forward_slot`]).
    fn forward_slot(&self) -> Option<OwnedSemaphorePermit> {
        Arc::clone(&self.forwards).try_acquire_owned().ok()
    }

    /// Relays a query upstream over the client's transport and returns the
    /// bytes to send back: the upstream's answer, or SERVFAIL. The slot is
    /// held until then.
    pub(crate) async fn relay(
        &self,
        _slot: ForwardSlot,
        query: &[u8],
        request: &Request,
        transport: Transport,
    ) -> Option<Vec<u8>> {
        let upstreams = self.usable_upstreams();
        let timeout = self.config.upstream_timeout;
        let answer = match transport {
            Transport::Udp => forward::over_udp(query, &upstreams, timeout).await,
            Transport::Tcp => forward::over_tcp(query, &upstreams, timeout).await,
        };
        answer.or_else(|| request.servfail())
    }
}

/// One per listener: its scope can change in place (a gateway handed to
/// another environment) without closing its sockets.
#[derive(Debug)]
pub(crate) struct ListenerCtx {
    pub(crate) scope: ArcSwap<Scope>,
    pub(crate) shared: Arc<Shared>,
    /// This listener's own forward slots.
    forwards: Arc<Semaphore>,
}

/// The right to one forwarded query: a slot of its listener and one of the
/// server, held until the answer is sent.
#[derive(Debug)]
pub(crate) struct ForwardSlot {
    _listener: OwnedSemaphorePermit,
    _server: OwnedSemaphorePermit,
}

impl ListenerCtx {
    pub(crate) fn new(scope: Scope, shared: Arc<Shared>) -> Self {
        let per = shared
            .config
            .max_forwards_per_listener
            .min(Semaphore::MAX_PERMITS);
        Self {
            scope: ArcSwap::from_pointee(scope),
            shared,
            forwards: Arc::new(Semaphore::new(per)),
        }
    }

    /// A slot for one forwarded query, or `None` when this listener has
    /// `max_forwards_per_listener` in flight, or the server `max_forwards`:
    /// the caller then answers SERVFAIL at once instead of queueing without
    /// bound. Taken in arrival order, before any task is spawned.
    pub(crate) fn forward_slot(&self) -> Option<ForwardSlot> {
        let listener = Arc::clone(&self.forwards).try_acquire_owned().ok()?;
        let server = self.shared.forward_slot()?;
        Some(ForwardSlot {
            _listener: listener,
            _server: server,
        })
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::upstream::UpstreamSource;

    #[test]
    fn own_listeners_are_never_upstreams() {
        let a: SocketAddr = "127.77.15.1:53".parse().unwrap();
        let b: SocketAddr = "127.77.15.2:53".parse().unwrap();
        let other_port: SocketAddr = "127.77.15.1:5353".parse().unwrap();
        let config = Config {
            port: 53,
            upstreams: UpstreamSource::Fixed(vec![a, b, other_port]),
            ..Config::default()
        };
        let shared = Shared::new(
            config.clone(),
            Arc::new(Upstreams::new(config.upstreams.clone())),
        );
        assert_eq!(shared.usable_upstreams(), vec![a, b, other_port]);
        shared.own.store(Arc::new(vec![a.ip()]));
        assert_eq!(shared.usable_upstreams(), vec![b, other_port]);
    }
}
