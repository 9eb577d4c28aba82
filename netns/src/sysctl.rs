//! The kernel switches the data path needs, written through /proc/sys.

use std::path::PathBuf;

use crate::error::{Error, Result};

#[allow(clippy::disallowed_methods)] // a kernel setting under /proc/sys, not a file on disk
fn write(key: &str, value: &'static str) -> Result<()> {
    let path = PathBuf::from("/proc/sys").join(key.replace('.', "/"));
    // Skip the write when already set: /proc/sys writes are cheap, but a
    // read-only /proc/sys (some containers) should not fail an idempotent call.
    if std::fs::read_to_string(&path).is_ok_and(|v| v.trim() == value) {
        return Ok(());
    }
    std::fs::write(&path, value).map_err(|source| Error::Sysctl {
        key: key.to_owned(),
        value,
        source,
    })
}

/// `net.ipv4.ip_forward=1`: containers' traffic is routed by the host.
pub fn enable_forwarding() -> Result<()> {
    write("net.ipv4.ip_forward", "1")
}

/// `route_localnet=1` on a bridge, so 127.0.0.1 can be DNATed to a
/// container behind it (published ports on loopback). It also lets a
/// container's crafted packet *to* 127.0.0.1 be routed to the host, which
/// the table's `guard` chain drops before routing (CVE-2020-8558).
pub fn enable_route_localnet(bridge: &str) -> Result<()> {
    write(&format!("net.ipv4.conf.{bridge}.route_localnet"), "1")
}

/// Strict reverse-path filtering on a bridge: a packet whose source would
/// not be routed back through the bridge is dropped (spoofing).
pub fn enable_rp_filter(bridge: &str) -> Result<()> {
    write(&format!("net.ipv4.conf.{bridge}.rp_filter"), "1")
}
