//! The sending side of BuildKit's `FileSync.DiffCopy` (the fsutil wire
//! protocol): one STAT packet per entry of the local directory in walk
//! order (each directory's entries sorted by name, parents first) and an
//! empty STAT to end the walk; the daemon asks for file bodies by the
//! index of their STAT (REQ), each answered by DATA packets and an empty
//! DATA; its FIN is answered with FIN.
//!
//! The daemon's include and exclude patterns (the Dockerfile's name, the
//! context's `.dockerignore`) are applied here, on the client side, as
//! fsutil does: the frontend relies on it.

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use bollard_buildkit_proto::fsutil::types::{Packet, Stat, packet::PacketType};
use globset::{Glob, GlobMatcher};

/// Go's `os.ModeDir`: fsutil's STAT mode is a Go `FileMode`.
const GO_MODE_DIR: u32 = 1 << 31;
/// Body chunks, as fsutil sends them.
const CHUNK: usize = 32 << 10;

/// Which entries of a directory are sent.
#[derive(Debug, Default)]
pub struct Filter {
    includes: Vec<(String, GlobMatcher)>,
    /// In order; a `!` pattern re-includes.
    excludes: Vec<(GlobMatcher, bool)>,
}

fn clean(pattern: &str) -> String {
    let p = pattern
        .trim()
        .trim_start_matches("./")
        .trim_start_matches('/');
    p.trim_end_matches('/').to_owned()
}

fn glob(pattern: &str) -> Result<GlobMatcher, String> {
    globset::GlobBuilder::new(pattern)
        .literal_separator(true)
        .build()
        .map(|g: Glob| g.compile_matcher())
        .map_err(|e| format!("pattern {pattern:?}: {e}"))
}

impl Filter {
    /// From the DiffCopy call's `include-patterns` (and `followpaths`,
    /// which name files to include) and `exclude-patterns`.
    pub fn new(includes: &[String], excludes: &[String]) -> Result<Self, String> {
        let mut f = Self::default();
        for p in includes
            .iter()
            .map(|p| clean(p))
            .filter(|p| !p.is_empty() && p != ".")
        {
            f.includes.push((p.clone(), glob(&p)?));
        }
        for p in excludes {
            let (negated, p) = match p.trim().strip_prefix('!') {
                Some(rest) => (true, clean(rest)),
                None => (false, clean(p)),
            };
            if !p.is_empty() {
                f.excludes.push((glob(&p)?, negated));
            }
        }
        Ok(f)
    }

    /// Whether `path` (relative, `/`-separated) or a parent of it matches.
    fn matches_self_or_parent(m: &GlobMatcher, path: &str) -> bool {
        let mut at = path.len();
        loop {
            if m.is_match(&path[..at]) {
                return true;
            }
            match path[..at].rfind('/') {
                Some(i) => at = i,
                None => return false,
            }
        }
    }

    fn excluded(&self, path: &str) -> bool {
        let mut out = false;
        for (m, negated) in &self.excludes {
            if Self::matches_self_or_parent(m, path) {
                out = !negated;
            }
        }
        out
    }

    /// Included: no include patterns, or one matches it or a parent.
    fn included(&self, path: &str) -> bool {
        self.includes.is_empty()
            || self
                .includes
                .iter()
                .any(|(_, m)| Self::matches_self_or_parent(m, path))
    }

    /// A directory is walked when something under it could be included.
    fn may_hold_included(&self, dir: &str) -> bool {
        self.includes.is_empty()
            || self.includes.iter().any(|(p, m)| {
                Self::matches_self_or_parent(m, dir)
                    || p.starts_with(&format!("{dir}/"))
                    || p.starts_with(['*', '?', '['])
                    || p.contains("**")
            })
    }

    fn has_negations(&self) -> bool {
        self.excludes.iter().any(|(_, n)| *n)
    }
}

/// The entries to send, in walk order: (relative path, STAT).
pub fn walk(root: &Path, filter: &Filter) -> std::io::Result<Vec<(PathBuf, Stat)>> {
    let mut out = Vec::new();
    walk_dir(root, "", filter, &mut out)?;
    Ok(out)
}

fn walk_dir(
    root: &Path,
    rel: &str,
    filter: &Filter,
    out: &mut Vec<(PathBuf, Stat)>,
) -> std::io::Result<()> {
    let dir = if rel.is_empty() {
        root.to_path_buf()
    } else {
        root.join(rel)
    };
    let mut names: Vec<_> = std::fs::read_dir(&dir)?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()?;
    names.sort();
    for name in names {
        let Some(name) = name.to_str() else { continue };
        let path = if rel.is_empty() {
            name.to_owned()
        } else {
            format!("{rel}/{name}")
        };
        let meta = std::fs::symlink_metadata(root.join(&path))?;
        let excluded = filter.excluded(&path);
        if meta.is_dir() {
            if excluded && !filter.has_negations() {
                continue;
            }
            if !filter.may_hold_included(&path) {
                continue;
            }
            let at = out.len();
            if !excluded && filter.included(&path) {
                out.push((PathBuf::from(&path), stat(&path, &meta, GO_MODE_DIR)));
            }
            walk_dir(root, &path, filter, out)?;
            // A directory kept only for what it holds is sent before it.
            if (excluded || !filter.included(&path)) && out.len() > at {
                out.insert(at, (PathBuf::from(&path), stat(&path, &meta, GO_MODE_DIR)));
            }
        } else if meta.is_file() && !excluded && filter.included(&path) {
            out.push((PathBuf::from(&path), stat(&path, &meta, 0)));
        }
        // Links and special files: a context never carries them (BLD-3).
    }
    Ok(())
}

fn stat(path: &str, meta: &std::fs::Metadata, kind: u32) -> Stat {
    Stat {
        path: path.to_owned(),
        mode: kind | (meta.mode() & 0o777),
        uid: 0,
        gid: 0,
        size: if kind == 0 {
            i64::try_from(meta.len()).unwrap_or(i64::MAX)
        } else {
            0
        },
        mod_time: meta.mtime() * 1_000_000_000 + meta.mtime_nsec(),
        ..Stat::default()
    }
}

/// The packets that answer the daemon, one step at a time.
#[derive(Debug)]
pub struct Sender {
    root: PathBuf,
    /// STAT index → path, for regular files not yet sent.
    files: HashMap<u32, PathBuf>,
}

impl Sender {
    /// The STAT packets (with the closing empty one) and the sender that
    /// answers requests for their bodies.
    pub fn start(root: &Path, filter: &Filter) -> std::io::Result<(Vec<Packet>, Self)> {
        let entries = walk(root, filter)?;
        let mut packets = Vec::with_capacity(entries.len() + 1);
        let mut files = HashMap::new();
        for (i, (path, st)) in entries.into_iter().enumerate() {
            let id = u32::try_from(i).unwrap_or(u32::MAX);
            if st.mode & GO_MODE_DIR == 0 {
                files.insert(id, path);
            }
            packets.push(Packet {
                r#type: PacketType::PacketStat as i32,
                stat: Some(st),
                ..Packet::default()
            });
        }
        packets.push(Packet {
            r#type: PacketType::PacketStat as i32,
            ..Packet::default()
        });
        Ok((
            packets,
            Self {
                root: root.to_path_buf(),
                files,
            },
        ))
    }

    /// The body of file `id` as DATA packets ending with an empty one,
    /// given to `send` chunk by chunk.
    pub fn body(&mut self, id: u32, mut send: impl FnMut(Packet) -> bool) -> Result<(), String> {
        let path = self
            .files
            .remove(&id)
            .ok_or_else(|| format!("invalid file id {id}"))?;
        let mut file = std::fs::File::open(self.root.join(&path))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = file
                .read(&mut buf)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            if n == 0 {
                break;
            }
            let data = Packet {
                r#type: PacketType::PacketData as i32,
                id,
                data: buf[..n].to_vec(),
                ..Packet::default()
            };
            if !send(data) {
                return Err("the daemon went away".into());
            }
        }
        send(Packet {
            r#type: PacketType::PacketData as i32,
            id,
            ..Packet::default()
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::disallowed_methods)]
    use super::*;

    fn tree() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (p, body) in [
            ("Dockerfile", "FROM x"),
            ("a.txt", "a"),
            ("a/b.txt", "b"),
            ("secrets/key", "k"),
            ("secrets/keep.pub", "p"),
            ("node_modules/x/index.js", "x"),
        ] {
            let path = dir.path().join(p);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, body).unwrap();
        }
        dir
    }

    fn paths(dir: &Path, f: &Filter) -> Vec<String> {
        walk(dir, f)
            .unwrap()
            .into_iter()
            .map(|(p, _)| p.display().to_string())
            .collect()
    }

    #[test]
    fn the_walk_is_sorted_per_directory_parents_first() {
        let dir = tree();
        assert_eq!(
            paths(dir.path(), &Filter::default()),
            [
                "Dockerfile",
                "a",
                "a/b.txt",
                "a.txt",
                "node_modules",
                "node_modules/x",
                "node_modules/x/index.js",
                "secrets",
                "secrets/keep.pub",
                "secrets/key"
            ]
        );
    }

    #[test]
    fn dockerignore_patterns_exclude_and_re_include() {
        let dir = tree();
        let f = Filter::new(
            &[],
            &[
                "node_modules".into(),
                "secrets/*".into(),
                "!secrets/*.pub".into(),
            ],
        )
        .unwrap();
        assert_eq!(
            paths(dir.path(), &f),
            [
                "Dockerfile",
                "a",
                "a/b.txt",
                "a.txt",
                "secrets",
                "secrets/keep.pub"
            ]
        );
    }

    #[test]
    fn include_patterns_send_only_the_dockerfile() {
        let dir = tree();
        let f = Filter::new(
            &["Dockerfile".into(), "Dockerfile.dockerignore".into()],
            &[],
        )
        .unwrap();
        assert_eq!(paths(dir.path(), &f), ["Dockerfile"]);
        let nested = Filter::new(&[".nixpacks/Dockerfile".into()], &[]).unwrap();
        std::fs::create_dir(dir.path().join(".nixpacks")).unwrap();
        std::fs::write(dir.path().join(".nixpacks/Dockerfile"), "FROM y").unwrap();
        assert_eq!(
            paths(dir.path(), &nested),
            [".nixpacks", ".nixpacks/Dockerfile"]
        );
    }

    #[test]
    fn stats_carry_go_modes_and_bodies_come_by_index() {
        let dir = tree();
        let (packets, mut sender) = Sender::start(dir.path(), &Filter::default()).unwrap();
        let a = packets[1].stat.as_ref().unwrap();
        assert_eq!(a.path, "a");
        assert_eq!(a.mode & GO_MODE_DIR, GO_MODE_DIR);
        assert!(
            packets.last().unwrap().stat.is_none(),
            "an empty STAT ends the walk"
        );
        let mut got = Vec::new();
        sender
            .body(0, |p| {
                got.push(p);
                true
            })
            .unwrap();
        assert_eq!(got[0].data, b"FROM x");
        assert!(
            got.last().unwrap().data.is_empty(),
            "an empty DATA ends the body"
        );
        assert!(sender.body(0, |_| true).is_err(), "sent once");
        assert!(sender.body(1, |_| true).is_err(), "a directory has no body");
    }
}
