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
        let (conn, handle, _) =
            rtnetlink::new_connection().map_err(|source| Error::NetlinkSocket { source })?;
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
        match stream.try_next().await {
            Ok(msg) => Ok(msg.as_ref().map(Link::from_message)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(Error::netlink("look up link", name, e)),
        }
    }

    pub async fn links(&self) -> Result<Vec<Link>> {
        let _turn = self.dumps.lock().await;
        self.handle
            .link()
            .get()
            .execute()
            .map_ok(|m| Link::from_message(&m))
            .try_collect()
            .await
            .map_err(|e| Error::netlink("list", "links", e))
    }

    /// Creates a bridge, down, with hardware address `mac` (a bridge that
    /// never has ports needs none). An address given
    /// by us is kept for the bridge's life; without one the kernel takes
    /// the lowest of its ports' and changes it as ports come and go, and
    /// every container's ARP entry for the gateway goes stale.
    pub async fn create_bridge(&self, name: &str, mac: Option<[u8; 6]>) -> Result<()> {
        let builder = LinkBridge::new(name);
        let msg = match mac {
            Some(mac) => builder.address(mac.to_vec()),
            None => builder,
        }
        .build();
        self.handle
            .link()
            .add(msg)
            .execute()
            .await
            .map_err(|e| Error::netlink("create bridge", name, e))
    }

    pub async fn set_alias(&self, link: &Link, alias: &str) -> Result<()> {
        let msg = LinkUnspec::new_with_index(link.index).alias(alias).build();
        self.handle
            .link()
            .set(msg)
            .execute()
            .await
            .map_err(|e| Error::netlink("set alias of", &link.name, e))
    }

    /// Renames a link (it must be down).
    pub async fn rename(&self, link: &Link, new_name: &str) -> Result<()> {
        let msg = LinkUnspec::new_with_index(link.index)
            .name(new_name.to_owned())
            .build();
        self.handle
            .link()
            .set(msg)
            .execute()
            .await
            .map_err(|e| Error::netlink("rename", format!("{} -> {new_name}", link.name), e))
    }

    /// Sets a link's hardware address (kept from then on, as at creation).
    pub async fn set_address(&self, index: u32, name: &str, mac: [u8; 6]) -> Result<()> {
        let msg = LinkUnspec::new_with_index(index)
            .address(mac.to_vec())
            .build();
        self.handle
            .link()
            .set(msg)
            .execute()
            .await
            .map_err(|e| Error::netlink("set the address of", name, e))
    }

    pub async fn set_up(&self, index: u32, name: &str) -> Result<()> {
        let msg = LinkUnspec::new_with_index(index).up().build();
        self.handle
            .link()
            .set(msg)
            .execute()
            .await
            .map_err(|e| Error::netlink("bring up", name, e))
    }

    /// Deletes a link; an absent one is not an error.
    pub async fn delete(&self, index: u32, name: &str) -> Result<()> {
        match self.handle.link().del(index).execute().await {
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
        self.handle
            .address()
            .get()
            .set_link_index_filter(index)
            .execute()
            .try_collect()
            .await
            .map_err(|e| Error::netlink("list addresses of", name, e))
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
        self.handle
            .address()
            .add(index, ip.into(), prefix)
            .replace()
            .execute()
            .await
            .map_err(|e| Error::netlink("add address to", format!("{name} ({ip}/{prefix})"), e))
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
        match self.handle.neighbours().del(entry).execute().await {
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
                match self.handle.address().del(m).execute().await {
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

    /// Links enslaved to the bridge with index `bridge`.
    pub async fn ports_of(&self, bridge: u32) -> Result<Vec<Link>> {
        Ok(self
            .links()
            .await?
            .into_iter()
            .filter(|l| l.controller == Some(bridge))
            .collect())
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
        self.handle
            .link()
            .add(msg)
            .execute()
            .await
            .map_err(|e| Error::netlink("create veth", format!("{host} <-> {peer}"), e))?;
        let link = self
            .link(host)
            .await?
            .ok_or_else(|| Error::Vanished(format!("veth {host}")))?;
        let msg = LinkBridgePort::new(link.index)
            .append_info_data(InfoBridgePort::HairpinMode(true))
            .build();
        self.handle
            .link()
            .set_port(msg)
            .execute()
            .await
            .map_err(|e| Error::netlink("set hairpin on", host, e))?;
        Ok(link)
    }

    pub async fn add_default_route(&self, gateway: Ipv4Addr) -> Result<()> {
        let route = RouteMessageBuilder::<Ipv4Addr>::new()
            .gateway(gateway)
            .build();
        self.handle
            .route()
            .add(route)
            .replace()
            .execute()
            .await
            .map_err(|e| Error::netlink("add default route via", gateway.to_string(), e))
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
