//! What the chaos loop wants to be running: the apps of its manifest
//! directory, the seeded generator that edits them, and the manifest text.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::support::TEST_IMAGE;

/// SplitMix64: tiny, and the same sequence for a seed on every machine and
/// every version, so that a printed seed replays a run exactly.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        if items.is_empty() {
            return None;
        }
        let i = usize::try_from(self.below(items.len() as u64)).unwrap_or(0);
        items.get(i)
    }
}

/// The app every fault spares: it prints a numbered line every 10 ms, so a
/// gap in its log file is a lost line.
pub const COUNTER: &str = "count";
/// The project of every app, and the environment names they use: two DNS
/// scopes.
pub const PROJECT: &str = "chaos";
pub const ENVS: [&str; 2] = ["prod", "stage"];
/// An app whose image does not fit the content store.
pub const TOO_BIG: &str = "big";

/// One app of the manifest directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct App {
    pub env: &'static str,
    pub replicas: u32,
    /// Bumped to change the config hash (every instance is replaced).
    pub generation: u32,
    /// Publishes container port 8080 on an ephemeral host port.
    pub publish: bool,
}

impl App {
    pub fn manifest(&self, name: &str) -> String {
        let command = if name == COUNTER {
            "i=0; while true; do i=$((i+1)); echo $i; sleep 0.01; done"
        } else {
            "trap 'exit 0' TERM; while true; do sleep 1; done"
        };
        let mut text = format!(
            "[app]\nname = \"{name}\"\nproject = \"{PROJECT}\"\n[build]\ntype = \"image\"\nimage = \"{TEST_IMAGE}\"\n\
             [env.{env}]\nreplicas = {replicas}\ncommand = \"{command}\"\nstop_grace = \"1s\"\n\
             [env.{env}.variables]\nGENERATION = \"{generation}\"\n",
            env = self.env,
            replicas = self.replicas,
            generation = self.generation,
        );
        if self.publish {
            let _ = write!(
                text,
                "[[env.{}.ports]]\nname = \"http\"\ncontainer_port = 8080\nprotocol = \"tcp\"\n",
                self.env
            );
        }
        text
    }
}

/// The manifest of the app that cannot be pulled into a full disk.
pub fn too_big_manifest(image: &str) -> String {
    format!(
        "[app]\nname = \"{TOO_BIG}\"\nproject = \"{PROJECT}\"\n[build]\ntype = \"image\"\nimage = \"{image}\"\n\
         [env.prod]\nreplicas = 1\ncommand = \"sleep 3600\"\n"
    )
}

/// The desired apps by name.
#[derive(Debug, Clone, Default)]
pub struct Desired {
    pub apps: BTreeMap<String, App>,
    /// Apps that existed once and were deleted: DNS must not answer them.
    pub gone: Vec<String>,
    /// Containers of a generation that was replaced: until they are gone
    /// from status, the agent has not caught up with the edit.
    pub stale: std::collections::BTreeSet<String>,
    next_name: u32,
}

impl Desired {
    /// The starting set: the counter and `apps` apps of three replicas
    /// across both scopes, some publishing a port.
    pub fn initial(apps: u32) -> Self {
        let mut d = Self::default();
        d.apps.insert(
            COUNTER.into(),
            App {
                env: ENVS[0],
                replicas: 1,
                generation: 0,
                publish: false,
            },
        );
        for i in 0..apps {
            d.add(ENVS[(i % 2) as usize], 3, i % 3 == 0);
        }
        d
    }

    pub fn add(&mut self, env: &'static str, replicas: u32, publish: bool) -> String {
        let name = format!("a{}", self.next_name);
        self.next_name += 1;
        self.gone.retain(|g| *g != name);
        self.apps.insert(
            name.clone(),
            App {
                env,
                replicas,
                generation: 0,
                publish,
            },
        );
        name
    }

    pub fn instances(&self) -> u32 {
        self.apps.values().map(|a| a.replicas).sum()
    }

    /// Names of the apps a fault may edit or delete (all but the counter).
    pub fn editable(&self) -> Vec<String> {
        self.apps
            .keys()
            .filter(|n| *n != COUNTER)
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_replays_the_same_sequence() {
        let a: Vec<u64> = (0..5)
            .map({
                let mut r = Rng::new(19);
                move |_| r.next_u64()
            })
            .collect();
        let b: Vec<u64> = (0..5)
            .map({
                let mut r = Rng::new(19);
                move |_| r.next_u64()
            })
            .collect();
        assert_eq!(a, b);
        assert_ne!(Rng::new(19).next_u64(), Rng::new(20).next_u64());
    }
}
