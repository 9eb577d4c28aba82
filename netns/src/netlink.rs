//! The narrow rtnetlink surface this crate needs: links, addresses, routes.
//! Everything else talks to the kernel through [`Netlink`], so the netlink
//! details (message builders, error codes) stay in this one file.
//!
//! A netlink socket is bound to the network namespace of the thread that
//! opened it; [`in_netns`] uses that to configure the inside of a container
//! namespace from a short-lived thread.

use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd};
use std::path::Path;
use std::time::Duration;

use futures::TryStreamExt;
use netlink_packet_route::address::AddressAttribute;
use netlink_packet_route::link::{
    InfoBridgePort, InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use rtnetlink::{
    Handle, LinkBridge, LinkBridgePort, LinkMessageBuilder, LinkUnspec, LinkVeth,
    RouteMessageBuilder,
};

use crate::error::{Error, Result};

const ENODEV: i32 = 19;
const ENOENT: i32 = 2;
const EADDRNOTAVAIL: i32 = 99;
const EEXIST: i32 = 17;

/// How long a request may wait for the kernel's answer. When a socket's
/// receive buffer overruns (hundreds of bring-ups at once), the kernel drops
/// answers; their requests would otherwise wait forever, and the bring-ups
/// behind them with them.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Room for the answers of many requests in flight on the shared socket
/// (the default is ~200 KiB); set with `SO_RCVBUFFORCE`, best effort.
const RECEIVE_BUFFER: usize = 4 << 20;

/// `request`'s outcome as the kernel gave it, or [`Error::NetlinkTimeout`]
/// if no answer came within `limit`.
async fn answered<T>(
    op: &'static str,
    object: impl Into<String>,
    limit: Duration,
    request: impl Future<Output = Result<T, rtnetlink::Error>>,
) -> Result<Result<T, rtnetlink::Error>> {
    tokio::time::timeout(limit, request)
        .await
        .map_err(|_| Error::NetlinkTimeout {
            op,
            object: object.into(),
            after: limit,
        })
}

/// `request` bounded by [`REQUEST_TIMEOUT`], its error named by `op` and
/// `object`.
async fn ask<T>(
    op: &'static str,
    object: impl Into<String> + Clone,
    request: impl Future<Output = Result<T, rtnetlink::Error>>,
) -> Result<T> {
    answered(op, object.clone(), REQUEST_TIMEOUT, request)
        .await?
        .map_err(|e| Error::netlink(op, object, e))
}

/// What we read back about one interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    /// The rtnetlink kind (`bridge`, `veth`, ...), `None` for plain devices.
    pub kind: Option<String>,
    pub alias: Option<String>,
    /// Index of the bridge this interface is a port of.
    pub controller: Option<u32>,
    pub mtu: u32,
    pub up: bool,
    /// Set on a veth whose peer lives in another namespace.
    pub peer_netns_id: Option<i32>,
    /// A veth's peer interface index (in the peer's namespace).
    pub peer_index: Option<u32>,
    /// The hardware address.
    pub address: Vec<u8>,
}

impl Link {
    fn from_message(msg: &LinkMessage) -> Self {
        let mut link = Link {
            index: msg.header.index,
            name: String::new(),
            kind: None,
            alias: None,
            controller: None,
            mtu: 0,
            up: msg.header.flags.contains(LinkFlags::Up),
            peer_netns_id: None,
            peer_index: None,
            address: Vec::new(),
        };
        for attr in &msg.attributes {
            match attr {
                LinkAttribute::IfName(n) => link.name.clone_from(n),
                LinkAttribute::IfAlias(a) => link.alias = Some(a.clone()),
                LinkAttribute::Controller(c) => link.controller = Some(*c),
                LinkAttribute::Mtu(m) => link.mtu = *m,
                LinkAttribute::LinkNetNsId(id) => link.peer_netns_id = Some(*id),
                LinkAttribute::Link(index) => link.peer_index = Some(*index),
                LinkAttribute::Address(a) => link.address.clone_from(a),
                LinkAttribute::LinkInfo(infos) => {
                    for info in infos {
                        if let LinkInfo::Kind(kind) = info {
                            link.kind = Some(kind_name(kind));
                        }
                    }
                }
                _ => {}
            }
        }
        link
    }

    pub fn is_bridge(&self) -> bool {
        self.kind.as_deref() == Some("bridge")
    }
}

fn kind_name(kind: &InfoKind) -> String {
    match kind {
        InfoKind::Bridge => "bridge".to_owned(),
        InfoKind::Veth => "veth".to_owned(),
        InfoKind::Dummy => "dummy".to_owned(),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// Whether a netlink error means "no such object".
pub(crate) fn is_not_found(err: &rtnetlink::Error) -> bool {
    matches!(err, rtnetlink::Error::NetlinkError(m)
        if [ENODEV, ENOENT, EADDRNOTAVAIL].contains(&-m.raw_code()))
}

/// Whether a netlink error means "already exists".
pub(crate) fn is_exists(err: &rtnetlink::Error) -> bool {
    matches!(err, rtnetlink::Error::NetlinkError(m) if -m.raw_code() == EEXIST)
}

/// A connection to rtnetlink in one network namespace.
#[derive(Debug, Clone)]
pub struct Netlink {
    handle: Handle,
    /// The kernel runs one dump at a time per socket and answers a second
    /// with EBUSY: bring-ups in parallel take turns.
    dumps: std::sync::Arc<tokio::sync::Mutex<()>>,
}

impl Netlink {
    /// Opens a connection in the calling thread's namespace and drives it on
    /// the current tokio runtime.
    pub fn connect() -> Result<Self> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|e| Error::NetlinkSocket {
            source: std::io::Error::other(format!("no tokio runtime to drive it: {e}")),
        })?;
        let (mut conn, handle, _) =
            rtnetlink::new_connection().map_err(|source| Error::NetlinkSocket { source })?;
        {
            use rtnetlink::sys::AsyncSocket;
            // Without CAP_NET_ADMIN this fails and the default stays; the
            // request timeout still bounds what a dropped answer costs.
            let _ = nix::sys::socket::setsockopt(
                conn.socket_mut().socket_ref(),
                nix::sys::socket::sockopt::RcvBufForce,
                &RECEIVE_BUFFER,
            );
        }
        runtime.spawn(conn);
        Ok(Self {
            handle,
            dumps: std::sync::Arc::default(),
        })
    }

    pub async fn link(&self, name: &str) -> Result<Option<Link>> {
        let mut stream = self
            .handle
            .link()
            .get()
            .match_name(name.to_owned())
            .execute();
        match answered("look up link", name, REQUEST_TIMEOUT, stream.try_next()).await? {
            Ok(msg) => Ok(msg.as_ref().map(Link::from_message)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(Error::netlink("look up link", name, e)),
        }
    }

    pub async fn links(&self) -> Result<Vec<Link>> {
        self.dump_links("links", None).await
    }

    /// Creates a bridge, down, with hardware address `mac` (a bridge that
    /// never has ports needs none). An address given
    /// by us is kept for the bridge's life; without one the kernel takes
    /// the lowest of its ports' and changes it as ports come and go, and
    /// every container's ARP entry for the gateway goes stale.
    pub async fn create_bridge(&self, name: &str, mac: Option<[u8; 6]>) -> Result<()> {
        // Not `LinkBridge::new`: it asks for the link up, and kernels before
        // 6.2 refuse to rename a link that is up (EBUSY), which the build
        // under a temporary name does next.
        let builder = LinkMessageBuilder::<LinkBridge>::new(name);
        let msg = match mac {
            Some(mac) => builder.address(mac.to_vec()),
            None => builder,
        }
        .build();
        ask("create bridge", name, self.handle.link().add(msg).execute()).await
    }

    pub async fn set_alias(&self, link: &Link, alias: &str) -> Result<()> {
        let msg = LinkUnspec::new_with_index(link.index).alias(alias).build();
        ask(
            "set alias of",
            &link.name,
            self.handle.link().set(msg).execute(),
        )
        .await
    }

    /// Renames a link (it must be down).
    pub async fn rename(&self, link: &Link, new_name: &str) -> Result<()> {
        let msg = LinkUnspec::new_with_index(link.index)
            .name(new_name.to_owned())
            .build();
        ask(
            "rename",
            format!("{} -> {new_name}", link.name),
            self.handle.link().set(msg).execute(),
        )
        .await
    }

    /// Sets a link's hardware address (kept from then on, as at creation).
    pub async fn set_address(&self, index: u32, name: &str, mac: [u8; 6]) -> Result<()> {
        let msg = LinkUnspec::new_with_index(index)
            .address(mac.to_vec())
            .build();
        ask(
            "set the address of",
            name,
            self.handle.link().set(msg).execute(),
        )
        .await
    }

    pub async fn set_up(&self, index: u32, name: &str) -> Result<()> {
        let msg = LinkUnspec::new_with_index(index).up().build();
        ask("bring up", name, self.handle.link().set(msg).execute()).await
    }

    /// Deletes a link; an absent one is not an error.
    pub async fn delete(&self, index: u32, name: &str) -> Result<()> {
        match answered(
            "delete",
            name,
            REQUEST_TIMEOUT,
            self.handle.link().del(index).execute(),
        )
        .await?
        {
            Err(e) if !is_not_found(&e) => Err(Error::netlink("delete", name, e)),
            _ => Ok(()),
        }
    }

    /// Deletes a link by name; an absent one is not an error.
    pub async fn delete_by_name(&self, name: &str) -> Result<bool> {
        match self.link(name).await? {
            Some(link) => self.delete(link.index, name).await.map(|()| true),
            None => Ok(false),
        }
    }

    async fn address_messages(
        &self,
        index: u32,
        name: &str,
    ) -> Result<Vec<netlink_packet_route::address::AddressMessage>> {
        let _turn = self.dumps.lock().await;
        let dump = self
            .handle
            .address()
            .get()
            .set_link_index_filter(index)
            .execute()
            .try_collect();
        ask("list addresses of", name, dump).await
    }

    pub async fn ipv4_addresses(&self, index: u32, name: &str) -> Result<Vec<(Ipv4Addr, u8)>> {
        let msgs = self.address_messages(index, name).await?;
        let mut out = Vec::new();
        for m in msgs {
            for attr in &m.attributes {
                if let AddressAttribute::Local(std::net::IpAddr::V4(ip))
                | AddressAttribute::Address(std::net::IpAddr::V4(ip)) = attr
                    && !out.iter().any(|(a, _)| a == ip)
                {
                    out.push((*ip, m.header.prefix_len));
                }
            }
        }
        Ok(out)
    }

    pub async fn add_address(
        &self,
        index: u32,
        name: &str,
        ip: Ipv4Addr,
        prefix: u8,
    ) -> Result<()> {
        ask(
            "add address to",
            format!("{name} ({ip}/{prefix})"),
            self.handle
                .address()
                .add(index, ip.into(), prefix)
                .replace()
                .execute(),
        )
        .await
    }

    /// Forgets what the host's neighbour (ARP) cache knows about `ip` on link
    /// `index`: an address reused by a new container comes with a new MAC,
    /// and a stale entry would blackhole traffic to it until the cache gives
    /// up on the old one (up to a minute).
    pub async fn forget_neighbour(&self, index: u32, name: &str, ip: Ipv4Addr) -> Result<()> {
        use netlink_packet_route::AddressFamily;
        use netlink_packet_route::neighbour::{
            NeighbourAddress, NeighbourAttribute, NeighbourMessage,
        };
        // Deleted by key (link and address), not found by a dump of the
        // whole table: a dump costs O(neighbours) per attach, and two at
        // once on the shared socket fail with EBUSY.
        let mut entry = NeighbourMessage::default();
        entry.header.family = AddressFamily::Inet;
        entry.header.ifindex = index;
        entry
            .attributes
            .push(NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)));
        let request = self.handle.neighbours().del(entry).execute();
        match answered(
            "forget the neighbour",
            ip.to_string(),
            REQUEST_TIMEOUT,
            request,
        )
        .await?
        {
            Ok(()) => Ok(()),
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code().abs() == ENOENT => Ok(()),
            Err(e) => Err(Error::netlink(
                "forget the neighbour",
                format!("{ip} on {name}"),
                e,
            )),
        }
    }

    /// Removes one IPv4 address from a link; an absent one is not an error.
    pub async fn remove_address(&self, index: u32, name: &str, ip: Ipv4Addr) -> Result<()> {
        let msgs = self.address_messages(index, name).await?;
        for m in msgs {
            let matches = m.attributes.iter().any(|a| {
                matches!(a, AddressAttribute::Local(std::net::IpAddr::V4(v))
                    | AddressAttribute::Address(std::net::IpAddr::V4(v)) if *v == ip)
            });
            if matches {
                let request = self.handle.address().del(m).execute();
                match answered("remove address from", name, REQUEST_TIMEOUT, request).await? {
                    Err(e) if !is_not_found(&e) => {
                        return Err(Error::netlink(
                            "remove address from",
                            format!("{name} ({ip})"),
                            e,
                        ));
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// A dump of the links, filtered by the kernel when `filter` is given:
    /// `IFLA_MASTER` or an `IFLA_LINKINFO` kind, which the kernel applies
    /// while it walks its devices, so a node with thousands of veths sends
    /// only the few that match. A kernel that ignores the filter sends
    /// every link: callers of a filtered dump check what they get.
    async fn dump_links(
        &self,
        what: &'static str,
        filter: Option<LinkAttribute>,
    ) -> Result<Vec<Link>> {
        let _turn = self.dumps.lock().await;
        let mut request = self.handle.link().get();
        request.message_mut().attributes.extend(filter);
        let dump = request
            .execute()
            .map_ok(|m| Link::from_message(&m))
            .try_collect();
        ask("list", what, dump).await
    }

    /// The bridges of this namespace.
    pub async fn bridges(&self) -> Result<Vec<Link>> {
        let kind = LinkAttribute::LinkInfo(vec![LinkInfo::Kind(InfoKind::Bridge)]);
        let mut links = self.dump_links("bridges", Some(kind)).await?;
        links.retain(Link::is_bridge);
        Ok(links)
    }

    /// Links enslaved to the bridge with index `bridge`.
    pub async fn ports_of(&self, bridge: u32) -> Result<Vec<Link>> {
        let master = LinkAttribute::Controller(bridge);
        let mut links = self.dump_links("ports of a bridge", Some(master)).await?;
        links.retain(|l| l.controller == Some(bridge));
        Ok(links)
    }

    /// Creates a veth pair in one request: `host` in this namespace, up, as
    /// a port of bridge `bridge`; `peer` directly inside the namespace behind
    /// `netns` (so it can be called `eth0` at once and never needs a move or
    /// a rename); both ends at `mtu`. Then turns hairpin on for the port, so
    /// a container can reach its own published port.
    pub async fn create_veth_into(
        &self,
        host: &str,
        bridge: u32,
        peer: &str,
        netns: &impl AsFd,
        mtu: u32,
    ) -> Result<Link> {
        let peer_msg = LinkUnspec::new_with_name(peer)
            .mtu(mtu)
            .setns_by_fd(netns.as_fd().as_raw_fd())
            .build();
        let msg = LinkMessageBuilder::<LinkVeth>::new_with_info_kind(InfoKind::Veth)
            .name(host.to_owned())
            .mtu(mtu)
            .controller(bridge)
            .up()
            .set_info_data(InfoData::Veth(InfoVeth::Peer(peer_msg)))
            .build();
        ask(
            "create veth",
            format!("{host} <-> {peer}"),
            self.handle.link().add(msg).execute(),
        )
        .await?;
        let link = self
            .link(host)
            .await?
            .ok_or_else(|| Error::Vanished(format!("veth {host}")))?;
        let msg = LinkBridgePort::new(link.index)
            .append_info_data(InfoBridgePort::HairpinMode(true))
            .build();
        ask(
            "set hairpin on",
            host,
            self.handle.link().set_port(msg).execute(),
        )
        .await?;
        Ok(link)
    }

    pub async fn add_default_route(&self, gateway: Ipv4Addr) -> Result<()> {
        let route = RouteMessageBuilder::<Ipv4Addr>::new()
            .gateway(gateway)
            .build();
        ask(
            "add default route via",
            gateway.to_string(),
            self.handle.route().add(route).replace().execute(),
        )
        .await
    }
}

/// Runs `work` with a [`Netlink`] bound to the namespace file at `path`, on a
/// dedicated thread that enters the namespace and then exits, so no thread of
/// the caller's runtime ever changes namespace.
pub async fn in_netns<T, F, Fut>(path: &Path, work: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce(Netlink) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<T>>,
{
    let path = path.to_owned();
    let what = format!("netns {}", path.display());
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("zt-netns".into())
        .spawn(move || {
            let _ = tx.send(run_in_netns(&path, work));
        })
        .map_err(|_| Error::Thread(what.clone()))?;
    rx.await.map_err(|_| Error::Thread(what))?
}

fn run_in_netns<T, F, Fut>(path: &Path, work: F) -> Result<T>
where
    F: FnOnce(Netlink) -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let file = std::fs::File::open(path).map_err(|e| Error::netns(path, "open", e))?;
    nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
        .map_err(|e| Error::netns(path, "enter (setns)", e))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::netns(path, "start a runtime for", e))?;
    rt.block_on(async {
        let nl = Netlink::connect()?;
        work(nl).await
    })
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    /// A request whose answer the kernel dropped never completes; it must
    /// end in an error that says so, not hang its bring-up.
    #[tokio::test]
    async fn an_unanswered_request_times_out_with_a_clear_error() {
        let never = std::future::pending::<Result<(), rtnetlink::Error>>();
        let err = answered("create veth", "a <-> b", Duration::from_millis(50), never)
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::NetlinkTimeout {
                    op: "create veth",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .contains("no answer to \"create veth a <-> b\""),
            "{err}"
        );
    }

    #[tokio::test]
    async fn an_answered_request_passes_the_kernels_outcome_through() {
        let ok = async { Ok::<u32, rtnetlink::Error>(7) };
        assert_eq!(ask("look up link", "x", ok).await.unwrap(), 7);
    }
}
