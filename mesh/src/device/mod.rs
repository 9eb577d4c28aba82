//! The userspace WireGuard device (`<agent> mesh-device IFNAME`): a tun with
//! TSO/GRO offloads, one UDP socket, boringtun's noise state machine per
//! peer, and the UAPI socket the agent configures it through.
//!
//! Threads: one per direction of the data path ([`datapath`]), one for the
//! peers' timers (handshake retries, keepalives, rekeys), one for the UAPI
//! socket. The peer table is behind a read-write lock that the data path
//! takes once per batch; each peer's tunnel behind its own mutex, taken per
//! packet, since both directions touch it.

mod config;
mod datapath;
mod peers;
mod udp;

use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::time::Duration;

use boringtun::noise::TunnResult;
use boringtun::noise::errors::WireGuardError;
use socket2::{Domain, Protocol, Socket, Type};

use crate::error::{Error, Result};
use crate::key::PublicKey;
use crate::uapi;
use config::{EINVAL, PeerGet, Set};
use peers::Peers;

/// The largest packet carried (the interface MTU may not exceed it).
pub(crate) const MAX_PACKET: usize = 9000;

/// How often the peers' timers run (boringtun's own device: 250 ms).
const TICK: Duration = Duration::from_millis(250);

pub(crate) struct Device {
    tun: tun_rs::SyncDevice,
    socket: RwLock<Arc<UdpSocket>>,
    port: RwLock<u16>,
    peers: RwLock<Peers>,
}

impl Device {
    fn socket(&self) -> Arc<UdpSocket> {
        Arc::clone(
            &self
                .socket
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    fn peers(&self) -> RwLockReadGuard<'_, Peers> {
        self.peers
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Creates the tun and the sockets, then serves until the tun's interface
/// goes or the process is stopped.
pub fn run(interface: &str) -> Result<()> {
    let err = |what: String| Error::Backend {
        interface: interface.to_owned(),
        backend: "userspace",
        what,
    };
    let path = uapi::socket_path(interface);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| err(format!("{}: {e}", dir.display())))?;
    }
    let tun = tun_rs::DeviceBuilder::new()
        .name(interface)
        .with(|b| {
            b.offload(true);
        })
        .build_sync()
        .map_err(|e| err(format!("creating the tun device: {e}")))?;
    tracing::info!(tcp_gso = tun.tcp_gso(), "tun device created");
    let socket = bind(0).map_err(|e| err(format!("binding the UDP socket: {e}")))?;
    let port = socket.local_addr().map_or(0, |a| a.port());
    let dev = Arc::new(Device {
        tun,
        socket: RwLock::new(Arc::new(socket)),
        port: RwLock::new(port),
        peers: RwLock::new(Peers::default()),
    });
    // A socket left by a device that died.
    let _ = std::fs::remove_file(&path);
    let listener =
        UnixListener::bind(&path).map_err(|e| err(format!("{}: {e}", path.display())))?;

    let spawn = |name: &str, f: fn(&Device) -> std::io::Result<()>| {
        let dev = Arc::clone(&dev);
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || f(&dev))
            .map_err(|e| err(format!("starting thread {name}: {e}")))
    };
    let out = spawn("mesh-out", datapath::outbound)?;
    let _in = spawn("mesh-in", datapath::inbound)?;
    let _timers = spawn("mesh-timers", timers)?;
    {
        let dev = Arc::clone(&dev);
        std::thread::Builder::new()
            .name("mesh-uapi".into())
            .spawn(move || serve_uapi(&dev, &listener))
            .map_err(|e| err(format!("starting the UAPI thread: {e}")))?;
    }
    // The tun's reader ends only when its interface is gone.
    let ended = out.join();
    let _ = std::fs::remove_file(&path);
    match ended {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(err(format!("the tun failed: {e}"))),
        Err(_) => Err(err("the tun reader panicked".into())),
    }
}

/// The listening socket on `port` (0: any), IPv4 (the mesh's underlay).
/// Blocking, with a receive timeout so that the receiver notices a new
/// socket after a port change; buffers as large as the system allows, so
/// that a burst of a super-packet's segments is not dropped. No
/// `SO_REUSEADDR` (56.10): with it on this socket, any local user's socket
/// with it too may bind the port on a more specific address and take the
/// mesh's datagrams.
fn bind(port: u16) -> std::io::Result<UdpSocket> {
    let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
    let _ = s.set_recv_buffer_size(4 << 20);
    let _ = s.set_send_buffer_size(4 << 20);
    s.bind(&SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)).into())?;
    s.set_read_timeout(Some(TICK))?;
    udp::enable_gro(&s);
    Ok(s.into())
}

/// [`bind`], waiting up to 2 s while the port is in use: a device this
/// process ran before (a restarted mesh) lets go of it within a [`TICK`].
fn bind_again(port: u16) -> std::io::Result<UdpSocket> {
    let mut tries = 0;
    loop {
        match bind(port) {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries < 8 => {
                tries += 1;
                std::thread::sleep(TICK);
            }
            other => return other,
        }
    }
}

/// Every [`TICK`]: each peer's timers (handshake retries, keepalives,
/// session expiry), and what they ask to send.
fn timers(dev: &Device) -> std::io::Result<()> {
    let mut buf = vec![0u8; MAX_PACKET + 64];
    loop {
        std::thread::sleep(TICK);
        let socket = dev.socket();
        let peers: Vec<_> = dev.peers().list.clone();
        for peer in peers {
            let mut tunn = peer.tunn();
            match tunn.update_timers(&mut buf) {
                TunnResult::WriteToNetwork(p) => {
                    if let Some(to) = peer.endpoint() {
                        let _ = socket.send_to(p, to);
                    }
                }
                TunnResult::Err(WireGuardError::ConnectionExpired) | TunnResult::Done => {}
                TunnResult::Err(e) => tracing::debug!(peer = %peer.key, error = ?e, "timer"),
                _ => {}
            }
        }
    }
}

/// Answers UAPI requests one connection at a time (the agent sends one
/// request per connection; `wg` may send several).
fn serve_uapi(dev: &Device, listener: &UnixListener) {
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
        if let Err(e) = answer(dev, conn) {
            tracing::debug!(error = %e, "UAPI connection");
        }
    }
}

fn answer(dev: &Device, conn: UnixStream) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut conn = conn;
    loop {
        let mut first = String::new();
        if reader.read_line(&mut first)? == 0 {
            return Ok(());
        }
        let mut body = String::new();
        if first.trim_end() == "set=1" {
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line)? == 0 || line.trim_end().is_empty() {
                    break;
                }
                body.push_str(&line);
            }
        }
        let text = match first.trim_end() {
            "get=1" => {
                // The request's closing empty line.
                let mut rest = String::new();
                reader.read_line(&mut rest)?;
                get(dev)
            }
            "set=1" => format!(
                "errno={}\n\n",
                config::parse_set(&body)
                    .and_then(|s| set(dev, s))
                    .err()
                    .unwrap_or(0)
            ),
            _ => format!("errno={EINVAL}\n\n"),
        };
        conn.write_all(text.as_bytes())?;
    }
}

fn get(dev: &Device) -> String {
    let peers = dev.peers();
    let own = peers.key.as_ref().map(|k| PublicKey(k.1.to_bytes()));
    let list: Vec<PeerGet> = peers
        .list
        .iter()
        .map(|p| {
            let (since, tx, rx, _, _) = p.tunn().stats();
            PeerGet {
                key: p.key,
                endpoint: p.endpoint(),
                allowed_ips: p.allowed_ips.clone(),
                keepalive: p.keepalive,
                since_handshake: since,
                rx_bytes: rx,
                tx_bytes: tx,
            }
        })
        .collect();
    let port = *dev
        .port
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    config::format_get(own, port, &list)
}

/// Applies a parsed `set=1`: key, port (a new socket), then the peers in
/// order.
fn set(dev: &Device, s: Set) -> std::result::Result<(), i32> {
    if let Some(port) = s.listen_port {
        let mut have = dev
            .port
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if *have != port {
            let socket = bind_again(port).map_err(|e| e.raw_os_error().unwrap_or(EINVAL))?;
            *dev.socket
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(socket);
            *have = port;
        }
    }
    let mut peers = dev
        .peers
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(k) = s.private_key {
        peers.set_key(k);
    }
    if s.replace_peers {
        peers.list.clear();
    }
    for p in s.peers {
        peers.apply(&p).map_err(|()| EINVAL)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 56.10: no other socket takes the mesh port's datagrams. With
    /// `SO_REUSEADDR` on the mesh's socket, another socket with it bound
    /// the same port on 127.0.0.1 (more specific, so it would receive).
    #[test]
    fn no_other_socket_can_bind_the_mesh_port() {
        let ours = bind(0).unwrap();
        let port = ours.local_addr().unwrap().port();
        let thief = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP)).unwrap();
        thief.set_reuse_address(true).unwrap();
        let taken = thief.bind(&SocketAddr::from((Ipv4Addr::LOCALHOST, port)).into());
        assert!(taken.is_err(), "another socket bound the mesh port {port}");
    }
}
