//! Every name the crate gives to a kernel object comes from one [`NetConfig`],
//! so that tests and several agents can run side by side without ever seeing
//! each other's bridges, veths, namespace files or nftables table.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::subnet::Subnet;

/// Names and paths of everything this crate creates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConfig {
    /// Prefix of every interface we create: bridges are `<prefix><slot>`,
    /// host veth ends `<prefix><slot>v<host octet>`. 2 to 8 lowercase ASCII
    /// letters, so a name never passes 15 characters and one prefix never
    /// parses as another's interface.
    pub bridge_prefix: String,
    /// Our nftables table, in family `inet`. Letters, digits and `_`.
    pub nft_table: String,
    /// Directory holding one network namespace file per container.
    pub netns_dir: PathBuf,
    /// The `nft` binary: a bare name is looked up on `PATH`.
    pub nft_binary: PathBuf,
    /// The node-local network of assignments without a subnet:
    /// bridge `<prefix>d`, host veths `<prefix>dv<host octet>`.
    pub default_subnet: Option<Subnet>,
    /// The network build steps run on ([`crate::firewall::BUILD_SCOPE`]):
    /// bridge `<prefix>b`, host veths `<prefix>bv<host octet>`.
    pub build_subnet: Option<Subnet>,
    /// Ranges no bridge may reach besides the mesh and link-local (the
    /// underlay, a VPC): containers and build steps alike.
    pub egress_deny: Vec<crate::firewall::Cidr>,
}

impl Default for NetConfig {
    fn default() -> Self {
        Self {
            bridge_prefix: "ztbr".to_owned(),
            nft_table: "zattera".to_owned(),
            netns_dir: PathBuf::from("/run/zattera/netns"),
            nft_binary: PathBuf::from("nft"),
            default_subnet: None,
            build_subnet: None,
            egress_deny: Vec::new(),
        }
    }
}

/// Interface names the kernel accepts: at most 15 bytes.
pub const IFNAMSIZ_MAX: usize = 15;

impl NetConfig {
    /// The agent's defaults with the table suffixed by the containerd
    /// namespace when it is not the default one (DESIGN decision 2).
    pub fn for_namespace(containerd_namespace: &str, run_dir: &std::path::Path) -> Result<Self> {
        let mut cfg = Self {
            netns_dir: run_dir.join("netns"),
            ..Self::default()
        };
        if containerd_namespace != "zattera" {
            let suffix: String = containerd_namespace
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect();
            cfg.nft_table = format!("zattera_{suffix}");
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Rejects names that could collide with someone else's objects or that
    /// the kernel or `nft` would not take.
    pub fn validate(&self) -> Result<()> {
        let p = &self.bridge_prefix;
        if !(2..=8).contains(&p.len()) || !p.bytes().all(|b| b.is_ascii_lowercase()) {
            return Err(Error::Config(format!(
                "bridge prefix {p:?} must be 2 to 8 lowercase ASCII letters"
            )));
        }
        let t = &self.nft_table;
        if t.is_empty()
            || t.len() > 64
            || !t.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            || !t.as_bytes()[0].is_ascii_alphabetic()
        {
            return Err(Error::Config(format!(
                "nft table name {t:?} must start with a letter and hold only letters, digits and '_'"
            )));
        }
        if !self.netns_dir.is_absolute() {
            return Err(Error::Config(format!(
                "netns dir {} must be an absolute path",
                self.netns_dir.display()
            )));
        }
        Ok(())
    }

    /// The bridge of one environment subnet, or of the default network.
    pub fn bridge_name(&self, subnet: Subnet) -> String {
        if self.default_subnet == Some(subnet) {
            format!("{}d", self.bridge_prefix)
        } else if self.build_subnet == Some(subnet) {
            format!("{}b", self.bridge_prefix)
        } else {
            format!("{}{}", self.bridge_prefix, subnet.slot())
        }
    }

    /// The rules entry of one network, for building a [`crate::FirewallState`]
    /// from the agent's records at start.
    pub fn bridge_rules(&self, subnet: Subnet, scope: &str) -> crate::firewall::BridgeRules {
        crate::firewall::BridgeRules {
            bridge: self.bridge_name(subnet),
            subnet,
            scope: scope.to_owned(),
        }
    }

    /// The host end of a container's veth: derived from its address, which
    /// IPAM never hands out twice, so two live attachments never share one.
    pub fn host_veth_name(&self, ip: Ipv4Addr) -> String {
        let o = ip.octets();
        if self.default_subnet.is_some_and(|d| d.contains(ip)) {
            format!("{}dv{}", self.bridge_prefix, o[3])
        } else if self.build_subnet.is_some_and(|b| b.contains(ip)) {
            format!("{}bv{}", self.bridge_prefix, o[3])
        } else {
            format!("{}{}v{}", self.bridge_prefix, o[2], o[3])
        }
    }

    /// Which of our names `ifname` is, if any.
    pub fn parse_ifname(&self, ifname: &str) -> Option<OwnedName> {
        let rest = ifname.strip_prefix(&self.bridge_prefix)?;
        if let (Some(tail), Some(default)) = (rest.strip_prefix('d'), self.default_subnet) {
            return parse_tail(tail, default);
        }
        if let (Some(tail), Some(build)) = (rest.strip_prefix('b'), self.build_subnet) {
            return parse_tail(tail, build);
        }
        let slot_end = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let slot: u8 = rest[..slot_end].parse().ok()?;
        if rest[..slot_end] != slot.to_string() {
            return None; // leading zeros: not a name we would make
        }
        parse_tail(&rest[slot_end..], Subnet::from_slot(slot))
    }

    /// Path of one container's network namespace file.
    pub fn netns_path(&self, container_id: &str) -> Result<PathBuf> {
        validate_container_id(container_id)?;
        Ok(self.netns_dir.join(container_id))
    }
}

/// What follows a bridge's name: nothing (the bridge), `t` (one being
/// built), or `v<host octet>` (a host veth).
fn parse_tail(tail: &str, subnet: Subnet) -> Option<OwnedName> {
    if tail.is_empty() {
        return Some(OwnedName::Bridge(subnet));
    }
    if tail == "t" {
        return Some(OwnedName::BridgeInProgress(subnet));
    }
    let digits = tail.strip_prefix('v')?;
    let host: u8 = digits.parse().ok()?;
    if host.to_string() != digits {
        return None;
    }
    Some(OwnedName::HostVeth(subnet.host(host)))
}

/// An interface name that belongs to this configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnedName {
    Bridge(Subnet),
    /// A bridge still being built (`<bridge>t`): renamed into place when done.
    BridgeInProgress(Subnet),
    /// The host end of a container's veth, named after the container's address.
    HostVeth(Ipv4Addr),
}

/// Container ids become file names: no separators, no dot names, bounded.
pub fn validate_container_id(id: &str) -> Result<()> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "container id {id:?} must be 1 to 128 characters of letters, digits, '-', '_' or '.'"
        )))
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn cfg(prefix: &str) -> NetConfig {
        NetConfig {
            bridge_prefix: prefix.to_owned(),
            ..NetConfig::default()
        }
    }

    #[test]
    fn names_fit_the_kernel_limit() {
        let c = cfg("abcdefgh");
        c.validate().unwrap();
        let ip = Ipv4Addr::new(10, 201, 255, 254);
        assert!(c.bridge_name(Subnet::from_slot(255)).len() <= IFNAMSIZ_MAX);
        assert!(c.host_veth_name(ip).len() <= IFNAMSIZ_MAX);
    }

    #[test]
    fn names_round_trip_and_foreign_names_do_not_parse() {
        let c = cfg("ztbr");
        let ip = Ipv4Addr::new(10, 201, 7, 42);
        assert_eq!(
            c.parse_ifname(&c.bridge_name(Subnet::from_slot(7))),
            Some(OwnedName::Bridge(Subnet::from_slot(7)))
        );
        assert_eq!(
            c.parse_ifname(&c.host_veth_name(ip)),
            Some(OwnedName::HostVeth(ip))
        );
        assert_eq!(
            c.parse_ifname("ztbr7t"),
            Some(OwnedName::BridgeInProgress(Subnet::from_slot(7)))
        );
        for foreign in [
            "eth0",
            "ztbr",
            "ztbr07",
            "ztbr256",
            "ztbrx1",
            "ztbr1v",
            "ztbr1p2",
            "ztbr1v300",
        ] {
            assert_eq!(c.parse_ifname(foreign), None, "{foreign}");
        }
        // The default network's names, and a prefix one letter longer.
        let d = Subnet::any_24("10.202.0.0/24").unwrap();
        let with_default = NetConfig {
            default_subnet: Some(d),
            ..cfg("ztbr")
        };
        let dip = d.host(9);
        assert_eq!(with_default.bridge_name(d), "ztbrd");
        assert_eq!(with_default.host_veth_name(dip), "ztbrdv9");
        assert_eq!(
            with_default.parse_ifname("ztbrd"),
            Some(OwnedName::Bridge(d))
        );
        assert_eq!(
            with_default.parse_ifname("ztbrdv9"),
            Some(OwnedName::HostVeth(dip))
        );
        assert_eq!(
            c.parse_ifname("ztbrd"),
            None,
            "no default network configured"
        );
        for foreign in ["ztbrd5", "ztbrdd", "ztbrd5v3", "ztbrddv3"] {
            assert_eq!(with_default.parse_ifname(foreign), None, "{foreign}");
        }
        // The build network's names.
        let b = Subnet::any_24("10.202.254.0/24").unwrap();
        let with_build = NetConfig {
            build_subnet: Some(b),
            ..cfg("ztbr")
        };
        assert_eq!(with_build.bridge_name(b), "ztbrb");
        assert_eq!(with_build.host_veth_name(b.host(7)), "ztbrbv7");
        assert_eq!(with_build.parse_ifname("ztbrb"), Some(OwnedName::Bridge(b)));
        assert_eq!(
            with_build.parse_ifname("ztbrbv7"),
            Some(OwnedName::HostVeth(b.host(7)))
        );
        assert_eq!(c.parse_ifname("ztbrb"), None, "no build network configured");
        // A longer prefix never parses under a shorter one, nor the reverse.
        assert_eq!(cfg("zt").parse_ifname("ztbr5"), None);
        assert_eq!(cfg("ztbra").parse_ifname("ztbr5"), None);
    }

    #[test]
    fn bad_config_is_refused() {
        assert!(cfg("zt1").validate().is_err());
        assert!(cfg("z").validate().is_err());
        assert!(cfg("abcdefghi").validate().is_err());
        let mut c = cfg("ztbr");
        c.nft_table = "bad name".into();
        assert!(c.validate().is_err());
        let mut c = cfg("ztbr");
        c.netns_dir = "relative".into();
        assert!(c.validate().is_err());
    }

    #[test]
    fn container_ids_are_safe_file_names() {
        validate_container_id("abc-123_x.y").unwrap();
        for bad in ["", ".", "..", "a/b", "a b", &"x".repeat(129)] {
            assert!(validate_container_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn namespace_suffixes_the_table() {
        let run = std::path::Path::new("/run/zattera");
        assert_eq!(
            NetConfig::for_namespace("zattera", run).unwrap().nft_table,
            "zattera"
        );
        assert_eq!(
            NetConfig::for_namespace("zt-test-1", run)
                .unwrap()
                .nft_table,
            "zattera_zt_test_1"
        );
    }
}
