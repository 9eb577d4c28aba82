//! Where the node's control streams dial (wire.md §1.2, §1.3 "Who dials",
//! runtime.md W-4): the raft leader, known from the latest non-empty
//! `PeerSet.leader_node_id`; an empty leader keeps the previous target;
//! after a failed attempt the next one rotates through the other known
//! control endpoints. Sync, route snapshots and WatchPeers each hold a
//! [`Dialer`] on the same [`Targets`].

use tokio::sync::watch;

use crate::proto::cluster::PeerSet;

/// The known control endpoints and the leader among them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Targets {
    /// `control_grpc_addr` first, then `<mesh_ip>:<port>` of every control
    /// peer.
    pub endpoints: Vec<String>,
    /// The current leader's address; the first guess is `control_grpc_addr`.
    pub leader: String,
}

impl Targets {
    /// Before any peer set: the address the join returned.
    pub fn initial(control_addr: &str) -> Self {
        Self {
            endpoints: vec![control_addr.to_owned()],
            leader: control_addr.to_owned(),
        }
    }

    /// The targets after `set` arrived (`control_addr` is the join's
    /// `control_grpc_addr`, whose port every control API uses).
    #[must_use]
    pub fn after(&self, control_addr: &str, set: &PeerSet) -> Self {
        let port = control_addr.rsplit_once(':').map_or("8443", |(_, p)| p);
        let at = |mesh_ip: &str| format!("{mesh_ip}:{port}");
        let mut endpoints = vec![control_addr.to_owned()];
        for p in set
            .peers
            .iter()
            .filter(|p| p.is_control && !p.mesh_ip.is_empty())
        {
            let e = at(&p.mesh_ip);
            if !endpoints.contains(&e) {
                endpoints.push(e);
            }
        }
        let leader = set
            .peers
            .iter()
            .find(|p| !set.leader_node_id.is_empty() && p.node_id == set.leader_node_id)
            .filter(|p| !p.mesh_ip.is_empty())
            .map_or_else(|| self.leader.clone(), |p| at(&p.mesh_ip));
        Self { endpoints, leader }
    }

    /// The leader first, then every other endpoint.
    fn order(&self) -> Vec<&str> {
        std::iter::once(self.leader.as_str())
            .chain(
                self.endpoints
                    .iter()
                    .map(String::as_str)
                    .filter(|e| *e != self.leader),
            )
            .collect()
    }
}

/// One client's view: which target to dial next.
#[derive(Debug, Clone)]
pub struct Dialer {
    targets: watch::Receiver<Targets>,
    /// Failed attempts since the last good session or leader change.
    misses: usize,
    leader: String,
}

impl Dialer {
    pub fn new(targets: watch::Receiver<Targets>) -> Self {
        let leader = targets.borrow().leader.clone();
        Self {
            targets,
            misses: 0,
            leader,
        }
    }

    /// A dialer that always answers `addr` (no mesh, tests).
    pub fn fixed(addr: &str) -> Self {
        // With its sender gone, `moved_from` never resolves.
        Self::new(watch::channel(Targets::initial(addr)).1)
    }

    /// The address to dial now.
    pub fn target(&mut self) -> String {
        let t = self.targets.borrow_and_update();
        if t.leader != self.leader {
            self.leader.clone_from(&t.leader);
            self.misses = 0;
        }
        let order = t.order();
        order[self.misses % order.len()].to_owned()
    }

    /// The last attempt failed: the next one tries the next endpoint.
    pub fn missed(&mut self) {
        self.misses += 1;
    }

    /// A session got going: the leader is first again.
    pub fn reached(&mut self) {
        self.misses = 0;
    }

    /// Resolves when the leader differs from `current` (a target dialed
    /// earlier); pending for ever when it never does.
    pub async fn moved_from(&mut self, current: &str) {
        loop {
            if self.targets.borrow_and_update().leader != current {
                return;
            }
            if self.targets.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::proto::cluster::Peer;

    fn set(leader: &str) -> PeerSet {
        let control = |id: &str, ip: &str| Peer {
            node_id: id.into(),
            mesh_ip: ip.into(),
            is_control: true,
            ..Peer::default()
        };
        PeerSet {
            version: 1,
            peers: vec![
                control("c1", "10.90.0.1"),
                control("c2", "10.90.0.2"),
                Peer {
                    node_id: "w1".into(),
                    mesh_ip: "10.90.1.1".into(),
                    ..Peer::default()
                },
            ],
            leader_node_id: leader.into(),
            ..PeerSet::default()
        }
    }

    #[test]
    fn the_leader_is_followed_and_an_empty_one_keeps_the_last() {
        let t = Targets::initial("10.90.0.1:8443");
        let t = t.after("10.90.0.1:8443", &set("c2"));
        assert_eq!(t.leader, "10.90.0.2:8443");
        assert_eq!(t.endpoints, vec!["10.90.0.1:8443", "10.90.0.2:8443"]);
        let t = t.after("10.90.0.1:8443", &set(""));
        assert_eq!(
            t.leader, "10.90.0.2:8443",
            "an election keeps the previous target"
        );
        let t = t.after("10.90.0.1:8443", &set("unknown"));
        assert_eq!(t.leader, "10.90.0.2:8443");
    }

    #[tokio::test]
    async fn misses_rotate_and_a_new_leader_resets_them() {
        let (tx, rx) =
            watch::channel(Targets::initial("10.90.0.1:8443").after("10.90.0.1:8443", &set("c1")));
        let mut d = Dialer::new(rx);
        assert_eq!(d.target(), "10.90.0.1:8443");
        d.missed();
        assert_eq!(d.target(), "10.90.0.2:8443");
        d.missed();
        assert_eq!(d.target(), "10.90.0.1:8443");
        d.missed();
        let moved = tx.borrow().after("10.90.0.1:8443", &set("c2"));
        tx.send_replace(moved);
        tokio::time::timeout(
            std::time::Duration::from_secs(1),
            d.moved_from("10.90.0.1:8443"),
        )
        .await
        .unwrap();
        assert_eq!(
            d.target(),
            "10.90.0.2:8443",
            "the new leader first, whatever missed before"
        );
    }
}
