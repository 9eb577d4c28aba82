//! In-kernel WireGuard over generic netlink (the `wireguard` family), as
//! `wg` does it. Peers are updated in place: the kernel keeps a peer's
//! session across a change of its endpoint or allowed IPs, and a peer that
//! did not change is not sent at all.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
use netlink_packet_generic::GenlMessage;
use netlink_packet_wireguard::{
    WireguardAddressFamily, WireguardAllowedIp, WireguardAllowedIpAttr, WireguardAttribute,
    WireguardCmd, WireguardMessage, WireguardPeer, WireguardPeerAttribute, WireguardPeerFlags,
};

use crate::error::{Error, Result};
use crate::key::PublicKey;
use crate::link;
use crate::state::{Inspect, MeshState, Net, PeerChanges, PeerStatus};

/// The kernel backend for one interface.
#[derive(Debug, Clone)]
pub struct Kernel {
    pub interface: String,
}

impl Kernel {
    fn err(&self, what: impl Into<String>) -> Error {
        Error::Backend {
            interface: self.interface.clone(),
            backend: "kernel",
            what: what.into(),
        }
    }

    /// Whether this kernel has WireGuard: creating the link tells. The link
    /// is left in place only when it was created for `apply`.
    pub async fn available(interface: &str) -> bool {
        let Ok(h) = link::connect() else {
            return false;
        };
        if link::index_of(&h, interface).await.ok().flatten().is_some() {
            return Self {
                interface: interface.to_owned(),
            }
            .read()
            .await
            .is_ok_and(|i| i.is_some());
        }
        let probe = format!("{}-probe", &interface[..interface.len().min(9)]);
        let ok = link::create_wireguard(&h, &probe).await.is_ok();
        let _ = link::delete(&h, &probe).await;
        ok
    }

    async fn request(
        &self,
        cmd: WireguardCmd,
        attributes: Vec<WireguardAttribute>,
        flags: u16,
    ) -> Result<Vec<WireguardMessage>> {
        let (conn, mut handle, _) = genetlink::new_connection().map_err(Error::Socket)?;
        let driver = tokio::spawn(conn);
        let mut msg = NetlinkMessage::from(GenlMessage::from_payload(WireguardMessage {
            cmd,
            attributes,
        }));
        msg.header.flags = flags;
        let mut out = Vec::new();
        let result = async {
            let mut answers = handle
                .request(msg)
                .await
                .map_err(|e| self.err(format!("generic netlink: {e}")))?;
            while let Some(answer) = answers.next().await {
                let answer = answer.map_err(|e| self.err(format!("decoding an answer: {e}")))?;
                match answer.payload {
                    NetlinkPayload::InnerMessage(m) => out.push(m.payload),
                    NetlinkPayload::Error(e) if e.code.is_some() => {
                        return Err(self.err(format!("{cmd:?}: {}", e.to_io())));
                    }
                    _ => {}
                }
            }
            Ok(())
        }
        .await;
        driver.abort();
        result.map(|()| out)
    }

    pub async fn read(&self) -> Result<Option<Inspect>> {
        let h = link::connect()?;
        if link::index_of(&h, &self.interface).await?.is_none() {
            return Ok(None);
        }
        let answers = self
            .request(
                WireguardCmd::GetDevice,
                vec![WireguardAttribute::IfName(self.interface.clone())],
                NLM_F_REQUEST | NLM_F_DUMP,
            )
            .await?;
        let mut out = Inspect {
            interface: self.interface.clone(),
            backend: "kernel",
            ..Inspect::default()
        };
        for m in answers {
            for a in m.attributes {
                match a {
                    WireguardAttribute::PublicKey(k) => {
                        out.public_key = Some(PublicKey(k).to_base64());
                    }
                    WireguardAttribute::ListenPort(p) => out.listen_port = p,
                    WireguardAttribute::Peers(peers) => {
                        out.peers.extend(peers.iter().map(peer_status));
                    }
                    _ => {}
                }
            }
        }
        Ok(Some(out))
    }

    pub async fn apply(&self, want: &MeshState) -> Result<()> {
        let h = link::connect()?;
        link::create_wireguard(&h, &self.interface).await?;
        let have = self.read().await?.unwrap_or_default();
        let changes = PeerChanges::between(&have.peers, &want.peers);
        let mut peers: Vec<WireguardPeer> = changes
            .remove
            .iter()
            .map(|k| {
                WireguardPeer(vec![
                    WireguardPeerAttribute::PublicKey(k.0),
                    WireguardPeerAttribute::Flags(WireguardPeerFlags::RemoveMe),
                ])
            })
            .collect();
        for k in &changes.upsert {
            let Some(p) = want.peers.get(k) else { continue };
            let mut attrs = vec![
                WireguardPeerAttribute::PublicKey(k.0),
                WireguardPeerAttribute::Flags(WireguardPeerFlags::ReplaceAllowedIps),
                WireguardPeerAttribute::PersistentKeepalive(p.keepalive),
                WireguardPeerAttribute::AllowedIps(
                    p.allowed_ips.iter().copied().map(allowed_ip).collect(),
                ),
            ];
            if let Some(e) = p.endpoints.first() {
                attrs.push(WireguardPeerAttribute::Endpoint(*e));
            }
            peers.push(WireguardPeer(attrs));
        }
        let own = want.private_key.public().to_base64();
        if !peers.is_empty()
            || have.public_key.as_deref() != Some(&own)
            || have.listen_port != want.listen_port
        {
            let mut attrs = vec![
                WireguardAttribute::IfName(self.interface.clone()),
                WireguardAttribute::PrivateKey(want.private_key.bytes()),
                WireguardAttribute::ListenPort(want.listen_port),
            ];
            if !peers.is_empty() {
                attrs.push(WireguardAttribute::Peers(peers));
            }
            self.request(WireguardCmd::SetDevice, attrs, NLM_F_REQUEST | NLM_F_ACK)
                .await?;
        }
        link::configure(&h, want).await
    }

    pub async fn remove(&self) -> Result<bool> {
        let h = link::connect()?;
        link::delete(&h, &self.interface).await
    }
}

fn allowed_ip(n: Net) -> WireguardAllowedIp {
    WireguardAllowedIp(vec![
        WireguardAllowedIpAttr::Family(WireguardAddressFamily::Ipv4),
        WireguardAllowedIpAttr::IpAddr(n.addr.into()),
        WireguardAllowedIpAttr::Cidr(n.prefix),
    ])
}

fn peer_status(p: &WireguardPeer) -> PeerStatus {
    let mut s = PeerStatus::named(None, "");
    for a in &p.0 {
        match a {
            WireguardPeerAttribute::PublicKey(k) => {
                s.key = Some(PublicKey(*k));
                s.public_key = PublicKey(*k).to_base64();
            }
            WireguardPeerAttribute::Endpoint(e) => s.endpoint = Some(*e),
            WireguardPeerAttribute::PersistentKeepalive(k) => s.keepalive = *k,
            WireguardPeerAttribute::RxBytes(b) => s.rx_bytes = *b,
            WireguardPeerAttribute::TxBytes(b) => s.tx_bytes = *b,
            WireguardPeerAttribute::LastHandshake(t) if t.seconds > 0 => {
                let at = UNIX_EPOCH
                    + Duration::new(
                        u64::try_from(t.seconds).unwrap_or(0),
                        u32::try_from(t.nano_seconds).unwrap_or(0),
                    );
                s.since_handshake = SystemTime::now().duration_since(at).ok();
            }
            WireguardPeerAttribute::AllowedIps(ips) => {
                for ip in ips {
                    let (mut addr, mut cidr) = (None, 32);
                    for a in &ip.0 {
                        match a {
                            WireguardAllowedIpAttr::IpAddr(std::net::IpAddr::V4(v4)) => {
                                addr = Some(*v4);
                            }
                            WireguardAllowedIpAttr::Cidr(c) => cidr = *c,
                            _ => {}
                        }
                    }
                    s.allowed_ips
                        .extend(addr.map(|addr| Net { addr, prefix: cidr }));
                }
            }
            _ => {}
        }
    }
    s
}
