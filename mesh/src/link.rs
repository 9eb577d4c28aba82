//! The interface's own network config over rtnetlink: MTU, up, the node's
//! mesh address, and the mesh CIDR routed through it. The same for both
//! backends; idempotent, so every apply runs it.

use futures::TryStreamExt;
use rtnetlink::{Handle, LinkUnspec, LinkWireguard, RouteMessageBuilder};

use crate::error::{Error, Result};
use crate::state::MeshState;

const EEXIST: i32 = 17;
const ENODEV: i32 = 19;

fn code_is(err: &rtnetlink::Error, code: i32) -> bool {
    matches!(err, rtnetlink::Error::NetlinkError(m) if -m.raw_code() == code)
}

/// A connection driven on the current tokio runtime, in the calling
/// thread's network namespace.
pub(crate) fn connect() -> Result<Handle> {
    let (conn, handle, _) = rtnetlink::new_connection().map_err(Error::Socket)?;
    tokio::spawn(conn);
    Ok(handle)
}

/// The index of `name`, if it exists.
pub(crate) async fn index_of(h: &Handle, name: &str) -> Result<Option<u32>> {
    let mut links = h.link().get().match_name(name.to_owned()).execute();
    match links.try_next().await {
        Ok(m) => Ok(m.map(|m| m.header.index)),
        Err(e) if code_is(&e, ENODEV) => Ok(None),
        Err(e) => Err(Error::netlink(name, "look up", e)),
    }
}

/// Creates a kernel WireGuard link (the kernel backend only).
pub(crate) async fn create_wireguard(h: &Handle, name: &str) -> Result<()> {
    match h
        .link()
        .add(LinkWireguard::new(name).build())
        .execute()
        .await
    {
        Err(e) if !code_is(&e, EEXIST) => Err(Error::netlink(name, "create (type wireguard)", e)),
        _ => Ok(()),
    }
}

/// MTU, up, address, route.
pub(crate) async fn configure(h: &Handle, want: &MeshState) -> Result<()> {
    let name = want.interface.as_str();
    let index = index_of(h, name).await?.ok_or_else(|| Error::Backend {
        interface: name.to_owned(),
        backend: "link",
        what: "the interface is gone".into(),
    })?;
    h.link()
        .set(LinkUnspec::new_with_index(index).mtu(want.mtu).up().build())
        .execute()
        .await
        .map_err(|e| Error::netlink(name, "set MTU and up", e))?;
    h.address()
        .add(index, want.address.into(), 32)
        .replace()
        .execute()
        .await
        .map_err(|e| Error::netlink(name, "add the mesh address", e))?;
    let route = RouteMessageBuilder::<std::net::Ipv4Addr>::new()
        .destination_prefix(want.cidr.addr, want.cidr.prefix)
        .output_interface(index)
        .pref_source(want.address)
        .build();
    h.route()
        .add(route)
        .replace()
        .execute()
        .await
        .map_err(|e| Error::netlink(name, "route the mesh CIDR", e))
}

/// Deletes the link; an absent one is not an error. Its addresses and
/// routes go with it.
pub(crate) async fn delete(h: &Handle, name: &str) -> Result<bool> {
    let Some(index) = index_of(h, name).await? else {
        return Ok(false);
    };
    match h.link().del(index).execute().await {
        Err(e) if !code_is(&e, ENODEV) => Err(Error::netlink(name, "delete", e)),
        _ => Ok(true),
    }
}
