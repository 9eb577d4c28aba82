//! Container addresses: `.2`–`.254` of each environment subnet (`.1` is the
//! gateway). The pool holds no file of its own: it is rebuilt from the
//! durable records the caller keeps (the agent's container labels), so a
//! crash or a reboot can never make it hand out an address twice.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use crate::error::{Error, Result};
use crate::subnet::Subnet;

const FIRST: u8 = 2;
const LAST: u8 = 254;

/// One durable record: `holder` (a container id) owns `ip`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpRecord {
    pub holder: String,
    pub ip: Ipv4Addr,
}

/// Address allocation for every subnet of this node.
#[derive(Debug, Default)]
pub struct Ipam {
    subnets: BTreeMap<Subnet, SubnetPool>,
}

#[derive(Debug, Default)]
struct SubnetPool {
    /// host octet -> holder
    held: BTreeMap<u8, String>,
    /// Last octet handed out: allocation goes round from there, so a freed
    /// address is reused as late as possible (stale ARP and conntrack entries
    /// of the old holder have time to expire).
    cursor: u8,
}

impl Ipam {
    /// Rebuilds the pool from records. Records outside the pool or on `.0`,
    /// `.1` or `.255` are errors: they mean the records are corrupt.
    pub fn from_records<'a>(records: impl IntoIterator<Item = &'a IpRecord>) -> Result<Self> {
        let mut ipam = Self::default();
        for r in records {
            ipam.reserve(&r.holder, r.ip)?;
        }
        Ok(ipam)
    }

    /// Marks `ip` as held by `holder`. Holding it already is fine; another
    /// holder is an error.
    pub fn reserve(&mut self, holder: &str, ip: Ipv4Addr) -> Result<()> {
        let (subnet, host) = split(ip)?;
        let pool = self.subnets.entry(subnet).or_default();
        match pool.held.get(&host) {
            Some(h) if h != holder => Err(Error::IpTaken {
                ip,
                holder: h.clone(),
            }),
            _ => {
                pool.held.insert(host, holder.to_owned());
                pool.cursor = pool.cursor.max(host);
                Ok(())
            }
        }
    }

    /// The address `holder` has in `subnet`, or a new one.
    pub fn allocate(&mut self, subnet: Subnet, holder: &str) -> Result<Ipv4Addr> {
        let pool = self.subnets.entry(subnet).or_default();
        if let Some((&host, _)) = pool.held.iter().find(|(_, h)| *h == holder) {
            return Ok(subnet.host(host));
        }
        let span = u16::from(LAST - FIRST + 1);
        let start = u16::from(pool.cursor.clamp(FIRST - 1, LAST));
        for step in 1..=span {
            let Ok(host) =
                u8::try_from((start + step - u16::from(FIRST)) % span + u16::from(FIRST))
            else {
                continue;
            };
            if let std::collections::btree_map::Entry::Vacant(slot) = pool.held.entry(host) {
                slot.insert(holder.to_owned());
                pool.cursor = host;
                return Ok(subnet.host(host));
            }
        }
        Err(Error::IpExhausted(subnet))
    }

    /// Frees `ip` if `holder` holds it; anything else is a no-op.
    pub fn release(&mut self, holder: &str, ip: Ipv4Addr) {
        let Ok((subnet, host)) = split(ip) else {
            return;
        };
        if let Some(pool) = self.subnets.get_mut(&subnet)
            && pool.held.get(&host).is_some_and(|h| h == holder)
        {
            pool.held.remove(&host);
        }
    }

    /// Addresses held in `subnet`, with their holders.
    pub fn held(&self, subnet: Subnet) -> Vec<IpRecord> {
        self.subnets.get(&subnet).map_or_else(Vec::new, |p| {
            p.held
                .iter()
                .map(|(&host, holder)| IpRecord {
                    holder: holder.clone(),
                    ip: subnet.host(host),
                })
                .collect()
        })
    }
}

fn split(ip: Ipv4Addr) -> Result<(Subnet, u8)> {
    let host = ip.octets()[3];
    let subnet = Subnet::containing(ip);
    if (FIRST..=LAST).contains(&host) {
        Ok((subnet, host))
    } else {
        Err(Error::IpOutside { ip, subnet })
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn rec(holder: &str, ip: [u8; 4]) -> IpRecord {
        IpRecord {
            holder: holder.into(),
            ip: ip.into(),
        }
    }

    #[test]
    fn hands_out_two_to_254_and_never_twice() {
        let s = Subnet::from_slot(9);
        let mut ipam = Ipam::default();
        let mut seen = std::collections::HashSet::new();
        for i in 0..253 {
            let ip = ipam.allocate(s, &format!("c{i}")).unwrap();
            assert!(s.contains(ip));
            assert!((2..=254).contains(&ip.octets()[3]), "{ip}");
            assert!(seen.insert(ip), "{ip} handed out twice");
        }
        assert!(matches!(
            ipam.allocate(s, "one-more"),
            Err(Error::IpExhausted(_))
        ));
        // The same holder asking again gets its own address back.
        assert_eq!(
            ipam.allocate(s, "c0").unwrap(),
            Ipv4Addr::new(10, 201, 9, 2)
        );
    }

    #[test]
    fn rebuilt_from_records_skips_held_addresses() {
        let records = [rec("a", [10, 201, 3, 2]), rec("b", [10, 201, 3, 3])];
        let mut ipam = Ipam::from_records(&records).unwrap();
        let ip = ipam.allocate(Subnet::from_slot(3), "c").unwrap();
        assert_eq!(ip, Ipv4Addr::new(10, 201, 3, 4));
        assert_eq!(ipam.held(Subnet::from_slot(3)).len(), 3);
    }

    #[test]
    fn freed_addresses_come_back_last() {
        let s = Subnet::from_slot(1);
        let mut ipam = Ipam::default();
        let a = ipam.allocate(s, "a").unwrap();
        ipam.release("a", a);
        assert_ne!(ipam.allocate(s, "b").unwrap(), a);
        // Releasing by the wrong holder does nothing.
        let b = Ipv4Addr::new(10, 201, 1, 3);
        ipam.release("a", b);
        assert!(matches!(ipam.reserve("x", b), Err(Error::IpTaken { .. })));
    }

    #[test]
    fn corrupt_records_are_errors() {
        for bad in [
            [10, 201, 3, 1],
            [10, 201, 3, 0],
            [10, 201, 3, 255],
            [10, 202, 0, 1],
        ] {
            assert!(Ipam::from_records(&[rec("a", bad)]).is_err(), "{bad:?}");
        }
        assert!(
            Ipam::from_records(&[rec("a", [10, 201, 3, 5]), rec("b", [10, 201, 3, 5])]).is_err()
        );
    }
}
