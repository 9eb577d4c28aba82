//! The cross-platform WireGuard configuration protocol (UAPI): `get=1` and
//! `set=1` over a unix socket, as `wg` speaks it to wireguard-go and
//! boringtun. Text in, text out; the parsing is pure and tested here.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use crate::error::{Error, Result};
use crate::key::{PrivateKey, PublicKey};
use crate::state::{Inspect, MeshState, PeerChanges, PeerStatus};

/// Where a userspace device named `interface` listens (the path `wg` uses).
pub fn socket_path(interface: &str) -> PathBuf {
    Path::new("/var/run/wireguard").join(format!("{interface}.sock"))
}

/// Reads the device.
pub async fn get(path: &Path) -> Result<Inspect> {
    let text = exchange(path, "get=1\n\n").await?;
    parse_get(&text).map_err(|errno| Error::UapiRefused {
        path: path.to_owned(),
        errno,
    })
}

/// Applies a `set=1` body (what [`set_body`] writes).
pub async fn set(path: &Path, body: &str) -> Result<()> {
    let text = exchange(path, &format!("set=1\n{body}\n")).await?;
    match errno_of(&text) {
        0 => Ok(()),
        errno => Err(Error::UapiRefused {
            path: path.to_owned(),
            errno,
        }),
    }
}

async fn exchange(path: &Path, request: &str) -> Result<String> {
    let io = |source| Error::Uapi {
        path: path.to_owned(),
        source,
    };
    let work = async {
        let mut stream = UnixStream::connect(path).await?;
        stream.write_all(request.as_bytes()).await?;
        let mut reader = BufReader::new(stream);
        let mut text = String::new();
        // The answer ends with `errno=N` and an empty line.
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).await? == 0 {
                break;
            }
            let done = line.starts_with("errno=");
            text.push_str(&line);
            if done {
                break;
            }
        }
        Ok::<_, std::io::Error>(text)
    };
    tokio::time::timeout(Duration::from_secs(5), work)
        .await
        .map_err(|_| io(std::io::Error::other("no answer in 5 s")))?
        .map_err(io)
}

fn errno_of(text: &str) -> i32 {
    text.lines()
        .find_map(|l| l.strip_prefix("errno="))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(-1)
}

/// The `set=1` body that takes the device from `have` to `want`: the key
/// and port when they differ, then only the peers `PeerChanges` names. A
/// changed peer is removed and added again (boringtun cannot modify one in
/// place).
pub fn set_body(want: &MeshState, have: &Inspect) -> Option<String> {
    let changes = PeerChanges::between(&have.peers, &want.peers);
    let own = want.private_key.public().to_base64();
    let key_ok = have.public_key.as_deref() == Some(own.as_str());
    let port_ok = have.listen_port == want.listen_port;
    if changes.is_empty() && key_ok && port_ok {
        return None;
    }
    let mut body = String::new();
    // The device needs its key before any peer.
    let _ = writeln!(body, "private_key={}", want.private_key.to_hex());
    if !port_ok {
        let _ = writeln!(body, "listen_port={}", want.listen_port);
    }
    let live: Vec<PublicKey> = have.peers.iter().filter_map(|p| p.key).collect();
    for k in &changes.remove {
        let _ = write!(body, "public_key={}\nremove=true\n", k.to_hex());
    }
    for k in &changes.upsert {
        let Some(p) = want.peers.get(k) else { continue };
        if live.contains(k) {
            let _ = write!(body, "public_key={}\nremove=true\n", k.to_hex());
        }
        let _ = writeln!(body, "public_key={}", k.to_hex());
        if let Some(e) = p.endpoints.first() {
            let _ = writeln!(body, "endpoint={e}");
        }
        if p.keepalive > 0 {
            let _ = writeln!(body, "persistent_keepalive_interval={}", p.keepalive);
        }
        for ip in &p.allowed_ips {
            let _ = writeln!(body, "allowed_ip={ip}");
        }
    }
    Some(body)
}

/// Parses a `get=1` answer; `Err(errno)` when the device refused.
pub(crate) fn parse_get(text: &str) -> Result<Inspect, i32> {
    let errno = errno_of(text);
    if errno != 0 {
        return Err(errno);
    }
    let mut out = Inspect {
        backend: "userspace",
        ..Inspect::default()
    };
    let mut handshake: (Option<u64>, u32) = (None, 0);
    let finish = |peer: &mut Option<PeerStatus>, hs: &mut (Option<u64>, u32), out: &mut Inspect| {
        if let Some(mut p) = peer.take() {
            p.since_handshake = hs.0.map(|s| Duration::new(s, hs.1));
            out.peers.push(p);
        }
        *hs = (None, 0);
    };
    let mut peer: Option<PeerStatus> = None;
    for line in text.lines() {
        let Some((k, v)) = line.split_once('=') else {
            continue;
        };
        match k {
            "own_public_key" => {
                out.public_key = PublicKey::from_hex(v).ok().map(|k| k.to_base64());
            }
            "private_key" => {
                out.public_key = PrivateKey::from_hex(v).ok().map(|k| k.public().to_base64());
            }
            "listen_port" => out.listen_port = v.parse().unwrap_or(0),
            "public_key" => {
                finish(&mut peer, &mut handshake, &mut out);
                peer = Some(PeerStatus::named(PublicKey::from_hex(v).ok(), v));
            }
            _ => {
                let Some(p) = peer.as_mut() else { continue };
                match k {
                    "endpoint" => p.endpoint = v.parse().ok(),
                    "allowed_ip" => p.allowed_ips.extend(v.parse::<crate::state::Net>().ok()),
                    "persistent_keepalive_interval" => p.keepalive = v.parse().unwrap_or(0),
                    "rx_bytes" => p.rx_bytes = v.parse().unwrap_or(0),
                    "tx_bytes" => p.tx_bytes = v.parse().unwrap_or(0),
                    // boringtun answers the time since the handshake here,
                    // not the epoch time the protocol names.
                    "last_handshake_time_sec" => handshake.0 = v.parse().ok(),
                    "last_handshake_time_nsec" => handshake.1 = v.parse().unwrap_or(0),
                    _ => {}
                }
            }
        }
    }
    finish(&mut peer, &mut handshake, &mut out);
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use std::collections::BTreeMap;
    use std::net::SocketAddr;

    use super::*;
    use crate::state::{Net, PeerConfig};

    fn state(peers: &[(u8, u16)]) -> MeshState {
        MeshState {
            interface: "zt0".into(),
            private_key: PrivateKey::from_base64(&PublicKey([7; 32]).to_base64()).unwrap(),
            listen_port: 51820,
            address: [10, 90, 1, 1].into(),
            cidr: "10.90.0.0/16".parse().unwrap(),
            mtu: 1420,
            peers: peers
                .iter()
                .map(|(n, port)| {
                    (
                        PublicKey([*n; 32]),
                        PeerConfig {
                            endpoints: vec![SocketAddr::from(([192, 0, 2, *n], *port))],
                            allowed_ips: vec![Net::host([10, 90, 1, *n].into())],
                            keepalive: 25,
                        },
                    )
                })
                .collect::<BTreeMap<_, _>>(),
        }
    }

    #[test]
    fn a_get_answer_parses_and_a_steady_device_needs_no_set() {
        let want = state(&[(2, 51820)]);
        let answer = format!(
            "own_public_key={}\nlisten_port=51820\npublic_key={}\npersistent_keepalive_interval=25\nendpoint=192.0.2.2:51820\nallowed_ip=10.90.1.2/32\nlast_handshake_time_sec=3\nlast_handshake_time_nsec=5\nrx_bytes=10\ntx_bytes=20\nerrno=0\n\n",
            want.private_key.public().to_hex(),
            PublicKey([2; 32]).to_hex()
        );
        let have = parse_get(&answer).unwrap();
        assert_eq!(have.peers.len(), 1);
        assert_eq!(have.peers[0].rx_bytes, 10);
        assert_eq!(have.peers[0].since_handshake, Some(Duration::new(3, 5)));
        assert_eq!(set_body(&want, &have), None);
        assert_eq!(parse_get("errno=19\n\n").unwrap_err(), 19);
    }

    #[test]
    fn a_set_names_only_what_changed() {
        let have = parse_get(&format!(
            "own_public_key={}\nlisten_port=51820\npublic_key={}\nendpoint=192.0.2.2:51820\nallowed_ip=10.90.1.2/32\npersistent_keepalive_interval=25\npublic_key={}\nendpoint=192.0.2.3:51820\nallowed_ip=10.90.1.3/32\npersistent_keepalive_interval=25\nerrno=0\n\n",
            state(&[]).private_key.public().to_hex(),
            PublicKey([2; 32]).to_hex(),
            PublicKey([3; 32]).to_hex(),
        ))
        .unwrap();
        // 2 stays, 3 goes, 4 comes.
        let body = set_body(&state(&[(2, 51820), (4, 51820)]), &have).unwrap();
        assert!(!body.contains(&PublicKey([2; 32]).to_hex()), "{body}");
        assert!(body.contains(&format!(
            "public_key={}\nremove=true",
            PublicKey([3; 32]).to_hex()
        )));
        assert!(body.contains(&format!(
            "public_key={}\nendpoint=192.0.2.4:51820",
            PublicKey([4; 32]).to_hex()
        )));
        assert!(body.starts_with("private_key="));
        // A moved peer is removed, then added.
        let body = set_body(&state(&[(2, 9), (3, 51820)]), &have).unwrap();
        let two = PublicKey([2; 32]).to_hex();
        assert!(
            body.contains(&format!(
                "public_key={two}\nremove=true\npublic_key={two}\nendpoint=192.0.2.2:9"
            )),
            "{body}"
        );
    }
}
