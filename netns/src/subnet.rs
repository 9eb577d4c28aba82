//! The environment subnet pool `10.201.0.0/16`, carved into `/24` slots
//! (runtime.md N-2, N-3).

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

/// First two octets of the pool every environment subnet comes from.
const POOL: [u8; 2] = [10, 201];

/// One `/24` the agent builds a bridge for: an environment subnet
/// `10.201.<slot>.0/24`, or the node-local default network that
/// assignments without a subnet get, which lies outside the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Subnet {
    /// The first three octets.
    net: [u8; 3],
}

impl Subnet {
    pub fn from_slot(slot: u8) -> Self {
        Self {
            net: [POOL[0], POOL[1], slot],
        }
    }

    /// `a.b.c.0/24`, for a constant.
    pub const fn from_octets(a: u8, b: u8, c: u8) -> Self {
        Self { net: [a, b, c] }
    }

    /// `a.b.c.0/24` wherever it is; for the default network. Only `FromStr`
    /// is strict about the pool (what control may push).
    pub fn any_24(cidr: &str) -> Result<Self, SubnetError> {
        let (addr, len) = parse_cidr(cidr)?;
        let o = addr.octets();
        if len != 24 || o[3] != 0 {
            return Err(SubnetError::Not24(cidr.to_owned()));
        }
        Ok(Self {
            net: [o[0], o[1], o[2]],
        })
    }

    /// The third octet: the slot of a pool subnet.
    pub fn slot(self) -> u8 {
        self.net[2]
    }

    /// Whether this is an environment subnet of `10.201.0.0/16`.
    pub fn in_pool(self) -> bool {
        self.net[..2] == POOL
    }

    pub fn network(self) -> Ipv4Addr {
        self.host(0)
    }

    /// The bridge's own address, `.1`.
    pub fn gateway(self) -> Ipv4Addr {
        self.host(1)
    }

    /// Host `n` of this /24 (`.1` is the gateway).
    pub fn host(self, n: u8) -> Ipv4Addr {
        Ipv4Addr::new(self.net[0], self.net[1], self.net[2], n)
    }

    /// The subnet `ip` belongs to, if it is inside the pool.
    pub fn of(ip: Ipv4Addr) -> Option<Self> {
        Some(Self::containing(ip)).filter(|s| s.in_pool())
    }

    /// The `/24` holding `ip`, in the pool or not.
    pub fn containing(ip: Ipv4Addr) -> Self {
        let o = ip.octets();
        Self {
            net: [o[0], o[1], o[2]],
        }
    }

    /// Whether `ip` is inside this /24.
    pub fn contains(self, ip: Ipv4Addr) -> bool {
        Self::containing(ip) == self
    }
}

impl fmt::Display for Subnet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/24", self.network())
    }
}

impl serde::Serialize for Subnet {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubnetError {
    #[error("subnet {0:?} is not an IPv4 CIDR")]
    Malformed(String),
    #[error("subnet {0:?} is not inside the environment pool 10.201.0.0/16")]
    OutsidePool(String),
    #[error("subnet {0:?} must be a /24 network address (10.201.X.0/24)")]
    NotSlot(String),
    #[error("subnet {0:?} must be a /24 network address (a.b.c.0/24)")]
    Not24(String),
    #[error("the 10.201.0.0/16 subnet pool is exhausted: all 256 /24 slots are in use")]
    Exhausted,
}

/// Parses `a.b.c.d/len` into address and prefix length.
fn parse_cidr(s: &str) -> Result<(Ipv4Addr, u8), SubnetError> {
    let malformed = || SubnetError::Malformed(s.to_owned());
    let (addr, len) = s.trim().split_once('/').ok_or_else(malformed)?;
    let addr: Ipv4Addr = addr.parse().map_err(|_| malformed())?;
    let len: u8 = len.parse().map_err(|_| malformed())?;
    if len > 32 {
        return Err(malformed());
    }
    Ok((addr, len))
}

impl FromStr for Subnet {
    type Err = SubnetError;

    /// Strict: only `10.201.X.0/24` is a subnet the agent will build.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (addr, len) = parse_cidr(s)?;
        let o = addr.octets();
        if o[0] != POOL[0] || o[1] != POOL[1] {
            return Err(SubnetError::OutsidePool(s.to_owned()));
        }
        if len != 24 || o[3] != 0 {
            return Err(SubnetError::NotSlot(s.to_owned()));
        }
        Ok(Self::from_slot(o[2]))
    }
}

/// `NextFreeSubnet(used)`: the lowest slot not in `used`. Entries that do not
/// parse or lie outside 10.201.0.0/16 are ignored; the prefix length is not
/// checked, so `10.201.3.128/25` marks slot 3 as used (N-2, exactly).
pub fn next_free_subnet<'a>(
    used: impl IntoIterator<Item = &'a str>,
) -> Result<Subnet, SubnetError> {
    let mut taken = [false; 256];
    for cidr in used {
        if let Ok((addr, _)) = parse_cidr(cidr) {
            let o = addr.octets();
            if o[0] == POOL[0] && o[1] == POOL[1] {
                taken[usize::from(o[2])] = true;
            }
        }
    }
    (0..=255u8)
        .find(|&slot| !taken[usize::from(slot)])
        .map(Subnet::from_slot)
        .ok_or(SubnetError::Exhausted)
}

/// `GatewayIP(cidr)`: the first three octets of the network address, then `.1`,
/// for any IPv4 CIDR (N-3). IPv6 and garbage are errors.
pub fn gateway_ip(cidr: &str) -> Result<Ipv4Addr, SubnetError> {
    let (addr, len) = parse_cidr(cidr)?;
    let mask = if len == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(len))
    };
    let o = Ipv4Addr::from(u32::from(addr) & mask).octets();
    Ok(Ipv4Addr::new(o[0], o[1], o[2], 1))
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn a_default_network_lies_anywhere_but_is_a_24() {
        let d = Subnet::any_24("10.202.0.0/24").unwrap();
        assert!(!d.in_pool());
        assert_eq!(d.gateway(), Ipv4Addr::new(10, 202, 0, 1));
        assert!(d.contains(Ipv4Addr::new(10, 202, 0, 9)));
        assert_eq!(Subnet::of(Ipv4Addr::new(10, 202, 0, 9)), None);
        assert_ne!(d, Subnet::from_slot(0));
        assert!("10.202.0.0/24".parse::<Subnet>().is_err());
        assert!(Subnet::any_24("10.202.0.0/16").is_err());
        assert!(Subnet::any_24("10.202.0.5/24").is_err());
    }

    #[test]
    fn next_free_is_the_lowest_unused_slot() {
        assert_eq!(next_free_subnet([]).unwrap().to_string(), "10.201.0.0/24");
        assert_eq!(
            next_free_subnet(["10.201.0.0/24", "10.201.1.0/24", "10.201.3.0/24"])
                .unwrap()
                .slot(),
            2
        );
    }

    #[test]
    fn next_free_ignores_garbage_and_foreign_ranges() {
        let used = [
            "garbage",
            "",
            "10.200.0.0/24",
            "192.168.0.0/24",
            "10.201.0.0/24",
            "fd00::/64",
        ];
        assert_eq!(next_free_subnet(used).unwrap().slot(), 1);
    }

    #[test]
    fn next_free_does_not_check_prefix_length() {
        assert_eq!(next_free_subnet(["10.201.0.128/25"]).unwrap().slot(), 1);
        assert_eq!(next_free_subnet(["10.201.0.0/16"]).unwrap().slot(), 1);
    }

    #[test]
    fn exhausted_pool_says_so() {
        let all: Vec<String> = (0..=255).map(|x| format!("10.201.{x}.0/24")).collect();
        let err = next_free_subnet(all.iter().map(String::as_str)).unwrap_err();
        assert_eq!(err, SubnetError::Exhausted);
        assert!(
            err.to_string()
                .contains("10.201.0.0/16 subnet pool is exhausted")
        );
        let mut all_but_last = all.clone();
        all_but_last.pop();
        assert_eq!(
            next_free_subnet(all_but_last.iter().map(String::as_str))
                .unwrap()
                .slot(),
            255
        );
    }

    #[test]
    fn gateway_is_dot_one_of_the_network() {
        assert_eq!(
            gateway_ip("10.201.7.0/24").unwrap(),
            Ipv4Addr::new(10, 201, 7, 1)
        );
        assert_eq!(
            gateway_ip("10.201.7.99/24").unwrap(),
            Ipv4Addr::new(10, 201, 7, 1)
        );
        assert_eq!(
            gateway_ip("172.16.5.0/24").unwrap(),
            Ipv4Addr::new(172, 16, 5, 1)
        );
        assert_eq!(
            gateway_ip("10.1.2.3/8").unwrap(),
            Ipv4Addr::new(10, 0, 0, 1)
        );
        for bad in ["", "10.201.7.0", "fd00::/64", "10.201.7.0/33", "nope/24"] {
            assert!(gateway_ip(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn strict_parse_accepts_only_pool_slots() {
        let s: Subnet = "10.201.42.0/24".parse().unwrap();
        assert_eq!(s.gateway(), Ipv4Addr::new(10, 201, 42, 1));
        assert!(s.contains(Ipv4Addr::new(10, 201, 42, 200)));
        assert!(!s.contains(Ipv4Addr::new(10, 201, 43, 2)));
        assert!(matches!(
            "10.200.1.0/24".parse::<Subnet>(),
            Err(SubnetError::OutsidePool(_))
        ));
        assert!(matches!(
            "10.201.1.0/25".parse::<Subnet>(),
            Err(SubnetError::NotSlot(_))
        ));
        assert!(matches!(
            "10.201.1.5/24".parse::<Subnet>(),
            Err(SubnetError::NotSlot(_))
        ));
        assert!(matches!(
            "x".parse::<Subnet>(),
            Err(SubnetError::Malformed(_))
        ));
    }
}
