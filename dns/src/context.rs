//! State shared by the receive loops: the name table, the upstreams and
//! the limits, plus each listener's scope.

use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::sync::Semaphore;

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
    forwards: Arc<Semaphore>,
    pub(crate) config: Config,
}

impl Shared {
    pub(crate) fn new(config: Config, upstreams: Arc<Upstreams>) -> Self {
        Self {
            table: ArcSwap::from_pointee(NameTable::empty()),
            upstreams,
            forwards: Arc::new(Semaphore::new(config.max_forwards)),
            config,
        }
    }

    /// Relays a query upstream over the client's transport and returns the
    /// bytes to send back: the upstream's answer, or SERVFAIL.
    pub(crate) async fn relay(
        &self,
        query: &[u8],
        request: &Request,
        transport: Transport,
    ) -> Option<Vec<u8>> {
        // Over the limit: fail fast rather than pile up sockets.
        let Ok(_slot) = Arc::clone(&self.forwards).try_acquire_owned() else {
            return request.servfail();
        };
        let upstreams = self.upstreams.get();
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
}
