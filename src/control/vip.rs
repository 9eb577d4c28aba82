//! The VIP proxy (runtime.md §9): a TCP listener on `VIP:port` for every
//! internal service port of the route snapshot, splicing each connection to
//! one healthy endpoint chosen by power of two choices over in-flight counts.
//!
//! DNS answers VIPs only, and container IPs are not routable across nodes,
//! so this is how `<app>.internal` reaches an instance anywhere. Reconcile
//! order follows V-2: addresses first, then listeners (new ones opened,
//! endpoint lists of existing ones swapped), then closing, then removing.
//!
//! Bounded against a peer that opens connections and never speaks: at most
//! [`MAX_CONNECTIONS`] are spliced at once (more are closed on accept), a
//! connection silent both ways for [`IDLE_TIMEOUT`] is closed, and an accept
//! error (EMFILE) backs off instead of spinning.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use zattera_netns::NetNode;

use crate::executor::LocalNetwork;
use crate::proto::cluster::RouteSnapshot;

const DIAL_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections spliced at once, over all VIPs.
pub const MAX_CONNECTIONS: usize = 4096;
/// A connection with no byte either way for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(600);
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// In-flight connections per endpoint address (V-3); an endpoint with none
/// left has no entry, so endpoints that come and go do not pile up.
type InFlight = Arc<Mutex<HashMap<SocketAddr, usize>>>;

/// One connection to `target` ended: its count goes down, and the entry
/// with it at zero.
fn release(in_flight: &mut HashMap<SocketAddr, usize>, target: SocketAddr) {
    if let Some(n) = in_flight.get_mut(&target) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            in_flight.remove(&target);
        }
    }
}

struct Listener {
    endpoints: Arc<RwLock<Vec<SocketAddr>>>,
    task: JoinHandle<()>,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What one snapshot asks for: VIPs with the networks that may reach them,
/// and healthy endpoints per `VIP:port`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Wanted {
    pub vips: BTreeMap<Ipv4Addr, BTreeSet<String>>,
    pub listeners: BTreeMap<SocketAddr, Vec<SocketAddr>>,
}

/// V-1: every service with a VIP; a listener per TCP port other than 0.
/// A VIP is reachable from the networks of the scope DNS answers it in
/// (D-7): its project, and its environment's *name* (the FQDN's second
/// label), so that `db.internal` from app `api` connects as it resolves.
pub fn wanted(snapshot: &RouteSnapshot, networks: &[LocalNetwork]) -> Wanted {
    let mut w = Wanted::default();
    for service in &snapshot.internal_services {
        let Ok(vip) = service.vip.parse::<Ipv4Addr>() else {
            continue;
        };
        let mut scopes = BTreeSet::from([zattera_netns::network_name(
            &service.project_id,
            &service.environment_id,
        )]);
        if let Some(env) = environment_label(&service.fqdn) {
            scopes.extend(
                networks
                    .iter()
                    .filter(|n| {
                        n.project_id == service.project_id
                            && n.environment.eq_ignore_ascii_case(env)
                    })
                    .map(|n| n.name.clone()),
            );
        }
        w.vips.entry(vip).or_default().extend(scopes);
        for port in &service.ports {
            let Ok(number) = u16::try_from(port.port) else {
                continue;
            };
            if number == 0 || port.protocol.eq_ignore_ascii_case("udp") {
                continue;
            }
            let healthy = port
                .endpoints
                .iter()
                .filter(|e| e.healthy)
                .filter_map(|e| e.addr.parse::<SocketAddr>().ok())
                .collect();
            w.listeners
                .insert(SocketAddr::new(vip.into(), number), healthy);
        }
    }
    w
}

/// `env` of `<app>.<env>.<project>.internal[.]`.
fn environment_label(fqdn: &str) -> Option<&str> {
    let labels: Vec<&str> = fqdn.trim_end_matches('.').split('.').collect();
    match labels.as_slice() {
        [_, env, _, internal] if internal.eq_ignore_ascii_case("internal") => Some(env),
        _ => None,
    }
}

/// Power of two choices: two distinct random picks, the one with fewer
/// connections in flight wins, the first on a tie (V-3).
pub fn choose(
    endpoints: &[SocketAddr],
    in_flight: &HashMap<SocketAddr, usize>,
    r1: usize,
    r2: usize,
) -> Option<SocketAddr> {
    match endpoints.len() {
        0 => None,
        1 => Some(endpoints[0]),
        n => {
            let a = endpoints[r1 % n];
            let mut b = endpoints[r2 % (n - 1)];
            if b == a {
                b = endpoints[n - 1];
            }
            let load = |e: &SocketAddr| in_flight.get(e).copied().unwrap_or(0);
            Some(if load(&b) < load(&a) { b } else { a })
        }
    }
}

/// Runs the proxy on every snapshot `routes` delivers and every change of
/// the node's networks, until `routes` closes or `shutdown` is cancelled:
/// then every VIP listener closes and the VIP addresses go (V-2).
pub async fn run(
    net: Arc<NetNode>,
    mut routes: watch::Receiver<Option<Arc<RouteSnapshot>>>,
    mut networks: watch::Receiver<Arc<Vec<LocalNetwork>>>,
    connections: prometheus_client::metrics::counter::Counter,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let in_flight: InFlight = Arc::default();
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut listeners: BTreeMap<SocketAddr, Listener> = BTreeMap::new();
    let mut networks_open = true;
    loop {
        let snapshot = routes.borrow_and_update().clone();
        let local = Arc::clone(&networks.borrow_and_update());
        if let Some(snapshot) = snapshot {
            let w = wanted(&snapshot, &local);
            reconcile(&net, &w, &mut listeners, &in_flight, &slots, &connections).await;
        }
        tokio::select! {
            changed = routes.changed() => if changed.is_err() {
                return;
            },
            // The executor gone only means no more network changes.
            changed = networks.changed(), if networks_open => networks_open = changed.is_ok(),
            () = shutdown.cancelled() => {
                listeners.clear();
                if let Err(e) = zattera_netns::vip::set_vips(&net, &BTreeMap::new()).await {
                    tracing::warn!(error = %e, "VIP addresses not removed at shutdown");
                }
                return;
            }
        }
    }
}

/// Applies one snapshot; a failed step is logged and retried with the next.
async fn reconcile(
    net: &NetNode,
    w: &Wanted,
    listeners: &mut BTreeMap<SocketAddr, Listener>,
    in_flight: &InFlight,
    slots: &Arc<tokio::sync::Semaphore>,
    connections: &prometheus_client::metrics::counter::Counter,
) {
    // 1. Addresses first: a listener cannot bind an address that is not there.
    let current: BTreeSet<Ipv4Addr> = listeners
        .keys()
        .filter_map(|a| match a {
            SocketAddr::V4(v4) => Some(*v4.ip()),
            SocketAddr::V6(_) => None,
        })
        .collect();
    // VIPs on their way out stay until their listeners close, reachable
    // from nobody.
    let mut all = w.vips.clone();
    for ip in current {
        all.entry(ip).or_default();
    }
    if let Err(e) = zattera_netns::vip::set_vips(net, &all).await {
        tracing::warn!(error = %e, "VIP addresses not set");
    }
    // 2. Open missing listeners, swap endpoints of existing ones.
    for (addr, endpoints) in &w.listeners {
        if let Some(l) = listeners.get(addr) {
            if let Ok(mut e) = l.endpoints.write() {
                e.clone_from(endpoints);
            }
            continue;
        }
        match TcpListener::bind(addr).await {
            Ok(socket) => {
                let shared = Arc::new(RwLock::new(endpoints.clone()));
                let task = tokio::spawn(accept(
                    socket,
                    Arc::clone(&shared),
                    Arc::clone(in_flight),
                    Arc::clone(slots),
                    connections.clone(),
                ));
                listeners.insert(
                    *addr,
                    Listener {
                        endpoints: shared,
                        task,
                    },
                );
                tracing::info!(%addr, endpoints = endpoints.len(), "VIP listener open");
            }
            Err(e) => {
                tracing::warn!(%addr, error = %e, "VIP listener not open; retried with the next snapshot");
            }
        }
    }
    // 3. Close listeners no longer wanted, 4. then drop their addresses.
    listeners.retain(|addr, _| w.listeners.contains_key(addr));
    if all != w.vips
        && let Err(e) = zattera_netns::vip::set_vips(net, &w.vips).await
    {
        tracing::warn!(error = %e, "stale VIP addresses not removed");
    }
}

async fn accept(
    socket: TcpListener,
    endpoints: Arc<RwLock<Vec<SocketAddr>>>,
    in_flight: InFlight,
    slots: Arc<tokio::sync::Semaphore>,
    connections: prometheus_client::metrics::counter::Counter,
) {
    loop {
        let client = match socket.accept().await {
            Ok((client, _)) => {
                connections.inc();
                client
            }
            Err(e) => {
                // Out of descriptors (EMFILE) and the like: the listener
                // stays readable, so retrying at once would spin.
                tracing::debug!(error = %e, "VIP accept failed; backing off");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        // Over the cap: closed at once, like a missing endpoint.
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            continue;
        };
        let candidates = endpoints.read().map(|e| e.clone()).unwrap_or_default();
        let chosen = {
            let Ok(counts) = in_flight.lock() else {
                continue;
            };
            choose(
                &candidates,
                &counts,
                rand::random::<u32>() as usize,
                rand::random::<u32>() as usize,
            )
        };
        // No healthy endpoint: the client is closed at once (V-3).
        let Some(first) = chosen else { continue };
        let in_flight = Arc::clone(&in_flight);
        tokio::spawn(async move {
            let _slot = slot;
            let Some((target, upstream)) = dial(first, &candidates).await else {
                return;
            };
            if let Ok(mut counts) = in_flight.lock() {
                *counts.entry(target).or_default() += 1;
            }
            copy_until_idle(client, upstream, IDLE_TIMEOUT).await;
            if let Ok(mut counts) = in_flight.lock() {
                release(&mut counts, target);
            }
        });
    }
}

/// Dials `first` with a 5 s timeout and, when that fails, once more
/// another of `candidates`: one endpoint gone since the snapshot
/// does not fail the client. `None` when neither answered.
pub async fn dial(first: SocketAddr, candidates: &[SocketAddr]) -> Option<(SocketAddr, TcpStream)> {
    let connect = |to: SocketAddr| async move {
        match tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(to)).await {
            Ok(Ok(s)) => Some((to, s)),
            _ => None,
        }
    };
    if let Some(ok) = connect(first).await {
        return Some(ok);
    }
    let others: Vec<SocketAddr> = candidates.iter().copied().filter(|c| *c != first).collect();
    let second = others.get(rand::random::<u32>() as usize % others.len().max(1))?;
    tracing::debug!(%first, %second, "VIP endpoint refused; retrying once on another");
    connect(*second).await
}

/// Both directions of `a` ⇄ `b`, closed after `idle` without a byte.
pub async fn copy_until_idle(a: TcpStream, b: TcpStream, idle: Duration) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut ar, mut aw) = a.into_split();
    let (mut br, mut bw) = b.into_split();
    let (mut buf_a, mut buf_b) = (vec![0u8; 16 * 1024], vec![0u8; 16 * 1024]);
    let (mut a_open, mut b_open) = (true, true);
    while a_open || b_open {
        tokio::select! {
            read = ar.read(&mut buf_a), if a_open => match read {
                Ok(0) | Err(_) => {
                    a_open = false;
                    let _ = bw.shutdown().await;
                }
                Ok(n) => {
                    if bw.write_all(&buf_a[..n]).await.is_err() {
                        return;
                    }
                }
            },
            read = br.read(&mut buf_b), if b_open => match read {
                Ok(0) | Err(_) => {
                    b_open = false;
                    let _ = aw.shutdown().await;
                }
                Ok(n) => {
                    if aw.write_all(&buf_b[..n]).await.is_err() {
                        return;
                    }
                }
            },
            () = tokio::time::sleep(idle) => return,
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::proto::cluster::{Endpoint, InternalPort, InternalService};

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[tokio::test]
    async fn a_silent_connection_is_closed_after_the_idle_time() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let a = TcpStream::connect(addr).await.unwrap();
        let (server_side, _) = l.accept().await.unwrap();
        let b_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let b_addr = b_listener.local_addr().unwrap();
        let upstream = TcpStream::connect(b_addr).await.unwrap();
        let (mut far, _) = b_listener.accept().await.unwrap();
        let splice = tokio::spawn(copy_until_idle(
            server_side,
            upstream,
            Duration::from_millis(300),
        ));
        // Bytes flow while there are any...
        let mut a = a;
        a.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        far.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ping");
        // ...and silence ends the splice, closing both sides.
        tokio::time::timeout(Duration::from_secs(3), splice)
            .await
            .expect("the idle splice ended")
            .unwrap();
        let mut rest = Vec::new();
        assert_eq!(far.read_to_end(&mut rest).await.unwrap(), 0);
    }

    #[test]
    fn an_endpoint_with_nothing_in_flight_leaves_the_map() {
        let (a, b) = (addr("10.0.0.1:80"), addr("10.0.0.2:80"));
        let mut m = HashMap::from([(a, 2), (b, 1)]);
        release(&mut m, a);
        release(&mut m, b);
        assert_eq!(m, HashMap::from([(a, 1)]));
        release(&mut m, a);
        release(&mut m, b);
        assert!(m.is_empty());
    }

    /// a refused dial is retried once on another endpoint.
    #[tokio::test]
    async fn a_refused_endpoint_is_retried_once_on_another() {
        let live = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let live_addr = live.local_addr().unwrap();
        let dead = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let (to, _) = dial(dead, &[dead, live_addr]).await.unwrap();
        assert_eq!(to, live_addr);
        assert!(dial(dead, &[dead]).await.is_none(), "no other endpoint");
    }

    #[test]
    fn power_of_two_choices_prefers_the_lighter_endpoint() {
        let e = [
            addr("127.0.0.1:1"),
            addr("127.0.0.1:2"),
            addr("127.0.0.1:3"),
        ];
        let mut load = HashMap::new();
        assert_eq!(choose(&[], &load, 0, 0), None);
        assert_eq!(choose(&e[..1], &load, 5, 7), Some(e[0]));
        load.insert(e[0], 4);
        assert_eq!(choose(&e, &load, 0, 1), Some(e[1]), "fewer in flight wins");
        assert_eq!(
            choose(&e, &HashMap::new(), 0, 1),
            Some(e[0]),
            "a tie keeps the first pick"
        );
        for r in 0..10 {
            let c = choose(&e[..2], &HashMap::new(), r, r).unwrap();
            assert!(e[..2].contains(&c));
        }
    }

    #[test]
    fn wanted_follows_v1() {
        let snapshot = RouteSnapshot {
            internal_services: vec![
                InternalService {
                    vip: "10.97.0.5".into(),
                    project_id: "01JPROJECTXYZ".into(),
                    environment_id: "01JENVIRONMENT42".into(),
                    ports: vec![
                        InternalPort {
                            port: 80,
                            protocol: "tcp".into(),
                            endpoints: vec![
                                Endpoint {
                                    addr: "127.0.0.1:8080".into(),
                                    healthy: true,
                                    ..Endpoint::default()
                                },
                                Endpoint {
                                    addr: "127.0.0.1:8081".into(),
                                    healthy: false,
                                    ..Endpoint::default()
                                },
                            ],
                            ..InternalPort::default()
                        },
                        InternalPort {
                            port: 53,
                            protocol: "UDP".into(),
                            ..InternalPort::default()
                        },
                        InternalPort {
                            port: 0,
                            protocol: "tcp".into(),
                            ..InternalPort::default()
                        },
                    ],
                    ..InternalService::default()
                },
                InternalService {
                    vip: String::new(),
                    ..InternalService::default()
                },
            ],
            ..RouteSnapshot::default()
        };
        let w = wanted(&snapshot, &[]);
        // Scoped to the bridges of its environment, named as the executor
        // names them.
        assert_eq!(
            w.vips,
            BTreeMap::from([(
                Ipv4Addr::new(10, 97, 0, 5),
                BTreeSet::from(["zt-01jproje-01jenvironme".to_owned()])
            )])
        );
        assert_eq!(w.listeners.len(), 1, "UDP and port 0 are skipped");
        assert_eq!(
            w.listeners[&addr("10.97.0.5:80")],
            vec![addr("127.0.0.1:8080")],
            "only healthy endpoints"
        );
    }

    #[test]
    fn a_vip_is_reached_from_every_network_of_its_project_and_environment_name() {
        let snapshot = RouteSnapshot {
            internal_services: vec![InternalService {
                fqdn: "db.Production.shop.internal.".into(),
                vip: "10.97.0.7".into(),
                project_id: "proj".into(),
                environment_id: "env-db".into(),
                ..InternalService::default()
            }],
            ..RouteSnapshot::default()
        };
        let net = |name: &str, project: &str, env: &str| LocalNetwork {
            name: name.into(),
            project_id: project.into(),
            environment: env.into(),
        };
        let networks = [
            net("zt-proj-env-api", "proj", "production"),
            net("zt-proj-env-web", "proj", "staging"),
            net("zt-other-env-x", "other", "production"),
        ];
        let w = wanted(&snapshot, &networks);
        assert_eq!(
            w.vips[&Ipv4Addr::new(10, 97, 0, 7)],
            BTreeSet::from(["zt-proj-env-api".to_owned(), "zt-proj-env-db".to_owned()])
        );
    }
}
