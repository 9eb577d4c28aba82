//! The interface that holds the service VIPs (runtime.md V-1, V-2): every VIP
//! of the route snapshot is a /32 on it, so the agent's proxy can listen on
//! `VIP:port` and containers reach it through their gateway.
//!
//! The reference uses a dummy device; kernels without the dummy driver exist
//! (this CI's), so the VIP holder is a port-less bridge `<prefix>vip` carrying
//! the alias `zattera:vip` as proof that it is ours. It stays when the last
//! VIP goes, as the reference's does.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use crate::error::{Error, Result};
use crate::node::NetNode;

pub const VIP_ALIAS: &str = "zattera:vip";

/// The VIP interface's name for this node's bridge prefix.
pub fn interface_name(node: &NetNode) -> String {
    format!("{}vip", node.config().bridge_prefix)
}

/// Makes the VIP interface carry exactly the VIPs of `scoped` (as /32s):
/// missing ones are added first, unwanted ones removed last (V-2). The
/// firewall follows: a VIP is reachable from the bridges of its scopes
/// ([`crate::network_name`]s) only; one with no scope from none.
pub async fn set_vips(node: &NetNode, scoped: &BTreeMap<Ipv4Addr, BTreeSet<String>>) -> Result<()> {
    let vips: BTreeSet<Ipv4Addr> = scoped.keys().copied().collect();
    let nl = node.netlink();
    let name = interface_name(node);
    let link = match nl.link(&name).await? {
        Some(link) if link.alias.as_deref() == Some(VIP_ALIAS) => link,
        Some(_) => {
            return Err(Error::Config(format!(
                "interface {name} exists but is not the agent's VIP interface (no alias {VIP_ALIAS})"
            )));
        }
        None => {
            // No ports ever join it, so its hardware address does not matter.
            nl.create_bridge(&name, None).await?;
            let link = nl.link(&name).await?.ok_or_else(|| {
                Error::Config(format!("interface {name} vanished after creation"))
            })?;
            nl.set_alias(&link, VIP_ALIAS).await?;
            link
        }
    };
    if !link.up {
        nl.set_up(link.index, &name).await?;
    }
    let current: BTreeSet<Ipv4Addr> = nl
        .ipv4_addresses(link.index, &name)
        .await?
        .into_iter()
        .filter(|(_, prefix)| *prefix == 32)
        .map(|(ip, _)| ip)
        .collect();
    for ip in vips.difference(&current) {
        nl.add_address(link.index, &name, *ip, 32).await?;
    }
    let mut rules = Vec::new();
    for (addr, scopes) in scoped {
        if scopes.is_empty() {
            rules.push(crate::ScopedVip {
                addr: *addr,
                scope: String::new(),
            });
        }
        rules.extend(scopes.iter().map(|scope| crate::ScopedVip {
            addr: *addr,
            scope: scope.clone(),
        }));
    }
    node.set_vips(rules).await?;
    for ip in current.difference(&vips) {
        nl.remove_address(link.index, &name, *ip).await?;
    }
    Ok(())
}
