//! Environment networks: one bridge per (project, environment) subnet,
//! holding the gateway `.1/24` (runtime.md N-4, N-5, X-3).
//!
//! The bridge name comes from the subnet slot (kernel names are 15
//! characters); the logical network name (the scope) is kept in the bridge's
//! alias as `zattera:<scope>`, which is also how a bridge is recognised as
//! ours: a bridge with our name but without that alias belongs to someone
//! else and is never touched.

use std::net::Ipv4Addr;

use crate::error::{Error, Result};
use crate::netlink::{Link, Netlink, is_exists};
use crate::subnet::Subnet;

/// Marks the alias of every bridge we create.
pub(crate) const ALIAS_PREFIX: &str = "zattera:";

/// One environment network as it exists in the kernel.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Network {
    /// The logical name (runtime.md N-1), e.g. `zt-project--01hxenvid000`.
    pub scope: String,
    pub subnet: Subnet,
    pub bridge: String,
    pub gateway: Ipv4Addr,
    pub mtu: u32,
    #[serde(skip)]
    pub(crate) index: u32,
}

/// runtime.md N-1: the logical network name of (project, environment),
/// `lowercase("zt-" + project[..8] + "-" + env[..12])`, by characters.
pub fn network_name(project_id: &str, environment_id: &str) -> String {
    let p: String = project_id.chars().take(8).collect();
    let e: String = environment_id.chars().take(12).collect();
    format!("zt-{p}-{e}").to_lowercase()
}

/// The scope recorded on a bridge of ours, or `None` if it is not ours.
pub(crate) fn owned_scope(link: &Link) -> Option<&str> {
    if !link.is_bridge() {
        return None;
    }
    link.alias.as_deref()?.strip_prefix(ALIAS_PREFIX)
}

pub(crate) fn validate_scope(scope: &str) -> Result<()> {
    if scope.is_empty() || scope.len() > 200 || !scope.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Error::Config(format!(
            "network name {scope:?} must be 1 to 200 printable ASCII characters without spaces"
        )));
    }
    Ok(())
}

/// The gateway's hardware address on the bridge of `subnet`: fixed, and
/// readable (locally administered `02:7a`, then the subnet's first three
/// octets), so that it never changes under the containers' ARP caches.
pub fn bridge_mac(subnet: Subnet) -> [u8; 6] {
    let [a, b, c, _] = subnet.network().octets();
    [0x02, 0x7a, a, b, c, 0x01]
}

/// Looks up our bridge for `subnet`: `Ok(None)` when absent, an error when
/// the name is taken by something that is not ours.
pub(crate) async fn lookup(nl: &Netlink, name: &str, subnet: Subnet) -> Result<Option<Network>> {
    let Some(link) = nl.link(name).await? else {
        return Ok(None);
    };
    let Some(scope) = owned_scope(&link) else {
        return Err(not_ours(&link));
    };
    Ok(Some(Network {
        scope: scope.to_owned(),
        subnet,
        bridge: link.name.clone(),
        gateway: subnet.gateway(),
        mtu: link.mtu,
        index: link.index,
    }))
}

pub(crate) fn not_ours(link: &Link) -> Error {
    let found = match (&link.kind, &link.alias) {
        (Some(k), Some(a)) => format!("a {k} with alias {a:?}"),
        (Some(k), None) => format!("a {k} without our alias"),
        (None, _) => "a plain device".to_owned(),
    };
    Error::NotOurs {
        name: link.name.clone(),
        found,
    }
}

/// Creates the bridge if missing, checks an existing one, and brings it up.
pub(crate) async fn ensure_bridge(
    nl: &Netlink,
    name: &str,
    scope: &str,
    subnet: Subnet,
) -> Result<Network> {
    validate_scope(scope)?;
    match ensure_once(nl, name, scope, subnet).await {
        // Someone created it between our look-up and our create: look again.
        Err(Error::Netlink {
            op: "create bridge" | "rename",
            source,
            ..
        }) if is_exists(&source) => ensure_once(nl, name, scope, subnet).await,
        other => other,
    }
}

async fn ensure_once(nl: &Netlink, name: &str, scope: &str, subnet: Subnet) -> Result<Network> {
    let alias = format!("{ALIAS_PREFIX}{scope}");
    let want = (subnet.gateway(), 24u8);
    if let Some(existing) = lookup(nl, name, subnet).await? {
        let addrs = nl.ipv4_addresses(existing.index, name).await?;
        let ports = nl.ports_of(existing.index).await?.len();
        let subnet_ok = addrs == [want];
        if subnet_ok && existing.scope == scope {
            pin_address(nl, &existing).await?;
            nl.set_up(existing.index, name).await?;
            return Ok(existing);
        }
        if ports > 0 {
            return Err(if subnet_ok {
                Error::ScopeInUse {
                    bridge: name.to_owned(),
                    wanted: scope.to_owned(),
                    found: existing.scope,
                    ports,
                }
            } else {
                Error::SubnetInUse {
                    bridge: name.to_owned(),
                    wanted: subnet,
                    found: describe(&addrs),
                    ports,
                }
            });
        }
        // Empty and stale: start again from nothing.
        tracing::info!(bridge = name, old_scope = %existing.scope, old = %describe(&addrs), new_scope = scope, %subnet, "re-creating stale empty bridge");
        nl.delete(existing.index, name).await?;
    }
    build(nl, name, &alias, subnet, scope).await
}

/// Gives a bridge made before addresses were pinned its fixed address.
async fn pin_address(nl: &Netlink, network: &Network) -> Result<()> {
    let mac = bridge_mac(network.subnet);
    match nl.link(&network.bridge).await? {
        Some(link) if link.address != mac => {
            tracing::info!(bridge = %network.bridge, "pinning the bridge's hardware address");
            nl.set_address(link.index, &network.bridge, mac).await
        }
        _ => Ok(()),
    }
}

/// Builds the bridge under a temporary name (`<name>t`) and renames it into
/// place only once it carries our alias and the gateway address: the kernel
/// ignores an alias given at creation, and this way a crash never leaves a
/// half-built bridge under the real name (gc removes temporary ones).
async fn build(
    nl: &Netlink,
    name: &str,
    alias: &str,
    subnet: Subnet,
    scope: &str,
) -> Result<Network> {
    let tmp = format!("{name}t");
    if let Some(stale) = nl.link(&tmp).await? {
        if !stale.is_bridge() {
            return Err(not_ours(&stale));
        }
        nl.delete(stale.index, &tmp).await?;
    }
    nl.create_bridge(&tmp, Some(bridge_mac(subnet))).await?;
    let built = async {
        let link = nl
            .link(&tmp)
            .await?
            .ok_or_else(|| Error::Vanished(format!("bridge {tmp}")))?;
        nl.set_alias(&link, alias).await?;
        nl.add_address(link.index, &tmp, subnet.gateway(), 24)
            .await?;
        nl.rename(&link, name).await?;
        nl.set_up(link.index, name).await?;
        Ok::<_, Error>(Network {
            scope: scope.to_owned(),
            subnet,
            bridge: name.to_owned(),
            gateway: subnet.gateway(),
            mtu: link.mtu,
            index: link.index,
        })
    }
    .await;
    if built.is_err() {
        // No half-built bridge left behind, under either name.
        let _ = nl.delete_by_name(&tmp).await;
    }
    built
}

fn describe(addrs: &[(Ipv4Addr, u8)]) -> String {
    if addrs.is_empty() {
        return "no address".to_owned();
    }
    addrs
        .iter()
        .map(|(a, p)| format!("{a}/{p}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    #[test]
    fn network_name_matches_the_reference() {
        assert_eq!(
            super::network_name("project-abcdefghXYZ", "01HXENVID000000000000"),
            "zt-project--01hxenvid000"
        );
        assert_eq!(super::network_name("p", "e"), "zt-p-e");
    }
}
