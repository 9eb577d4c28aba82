//! Server settings; the defaults are the spec's numbers (D-4) and limits
//! sized for one node.

use std::time::Duration;

use crate::upstream::UpstreamSource;

/// Settings of a [`crate::DnsServer`].
#[derive(Debug, Clone)]
pub struct Config {
    /// Port of every listener: 53 (tests and benchmarks may pick another).
    pub port: u16,
    /// Where non-internal queries go.
    pub upstreams: UpstreamSource,
    /// Time given to each upstream before the next is tried (D-4: 2 s).
    pub upstream_timeout: Duration,
    /// How often the resolv.conf files are checked for changes.
    pub upstream_poll: Duration,
    /// UDP sockets per listener (`SO_REUSEPORT`), each with its own receive
    /// loop, so the kernel spreads queries over the cores.
    pub udp_sockets: usize,
    /// Bind with `IP_FREEBIND`, so a listener can open before its bridge
    /// carries the gateway address (the X-2 race).
    pub freebind: bool,
    /// Open TCP connections per listener; more are closed at once.
    pub tcp_max_connections: usize,
    /// A TCP connection idle (or stalled mid-message) this long is closed.
    pub tcp_idle_timeout: Duration,
    /// Forwarded queries in flight per server; past that a query gets
    /// SERVFAIL at once instead of queueing without bound.
    pub max_forwards: usize,
    /// Forwarded queries in flight per listener (one environment's
    /// gateway): one environment flooding a dead domain exhausts its own
    /// slots, never the others'.
    pub max_forwards_per_listener: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            port: 53,
            upstreams: UpstreamSource::default(),
            upstream_timeout: Duration::from_secs(2),
            upstream_poll: Duration::from_secs(2),
            udp_sockets: std::thread::available_parallelism().map_or(1, |n| n.get().min(4)),
            freebind: true,
            tcp_max_connections: 128,
            tcp_idle_timeout: Duration::from_secs(10),
            max_forwards: 1024,
            max_forwards_per_listener: 128,
        }
    }
}
