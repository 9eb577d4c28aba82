//! The image's `User` as ids (runtime.md C-5), the way Docker's runc does
//! it: `user[:group]`, each part a name or a number, looked up in the
//! rootfs's `/etc/passwd` and `/etc/group`.
//!
//! - a user name must exist; a number may be absent from passwd (then the
//!   primary group is 0, as in Docker);
//! - without a group, the primary group is the passwd entry's, and the
//!   groups that list the user as a member become supplementary groups;
//! - with a group, that group (a name must exist) is the primary one and no
//!   supplementary groups are added.

use super::spec::ProcessUser;

struct PasswdEntry<'a> {
    name: &'a str,
    uid: u32,
    gid: u32,
}

fn passwd_entries(text: &str) -> impl Iterator<Item = PasswdEntry<'_>> {
    text.lines().filter_map(|l| {
        let f: Vec<&str> = l.trim().split(':').collect();
        Some(PasswdEntry {
            name: f.first().filter(|n| !n.is_empty() && !n.starts_with('#'))?,
            uid: f.get(2)?.parse().ok()?,
            gid: f.get(3)?.parse().ok()?,
        })
    })
}

/// (name, gid, members) of each group line.
fn group_entries(text: &str) -> impl Iterator<Item = (&str, u32, Vec<&str>)> {
    text.lines().filter_map(|l| {
        let f: Vec<&str> = l.trim().split(':').collect();
        let name = f.first().filter(|n| !n.is_empty() && !n.starts_with('#'))?;
        let gid = f.get(2)?.parse().ok()?;
        let members = f
            .get(3)
            .map(|m| {
                m.split(',')
                    .map(str::trim)
                    .filter(|m| !m.is_empty())
                    .collect()
            })
            .unwrap_or_default();
        Some((*name, gid, members))
    })
}

/// Resolves `spec` against the image's passwd and group files (`None`
/// when the image has none).
pub fn resolve(
    spec: &str,
    passwd: Option<&str>,
    group: Option<&str>,
) -> Result<ProcessUser, String> {
    let spec = spec.trim();
    let (user_part, group_part) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    let passwd = passwd.unwrap_or("");
    let group = group.unwrap_or("");
    let (uid, primary, name) = if user_part.is_empty() {
        (0, 0, Some("root".to_owned()))
    } else if let Ok(uid) = user_part.parse::<u32>() {
        let entry = passwd_entries(passwd).find(|e| e.uid == uid);
        (
            uid,
            entry.as_ref().map_or(0, |e| e.gid),
            entry.map(|e| e.name.to_owned()),
        )
    } else {
        let entry = passwd_entries(passwd)
            .find(|e| e.name == user_part)
            .ok_or_else(|| format!("user {user_part:?} is not in the image's /etc/passwd"))?;
        (entry.uid, entry.gid, Some(entry.name.to_owned()))
    };
    match group_part {
        Some(g) if !g.is_empty() => {
            let gid = match g.parse::<u32>() {
                Ok(gid) => gid,
                Err(_) => group_entries(group)
                    .find(|(n, _, _)| *n == g)
                    .map(|(_, gid, _)| gid)
                    .ok_or_else(|| format!("group {g:?} is not in the image's /etc/group"))?,
            };
            Ok(ProcessUser {
                uid,
                gid,
                additional_gids: Vec::new(),
            })
        }
        _ => {
            let mut additional: Vec<u32> = match &name {
                Some(n) if !user_part.is_empty() => group_entries(group)
                    .filter(|(_, _, members)| members.contains(&n.as_str()))
                    .map(|(_, gid, _)| gid)
                    .filter(|gid| *gid != primary)
                    .collect(),
                _ => Vec::new(),
            };
            additional.sort_unstable();
            additional.dedup();
            Ok(ProcessUser {
                uid,
                gid: primary,
                additional_gids: additional,
            })
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n# comment\nnginx:x:101:101:nginx:/var/cache/nginx:/sbin/nologin\napp:x:1000:1000::/home/app:/bin/sh\n";
    const GROUP: &str = "root:x:0:\nnginx:x:101:\napp:x:1000:\nwww:x:33:nginx,app\nadm:x:4:app\n";

    fn ids(u: &ProcessUser) -> (u32, u32, Vec<u32>) {
        (u.uid, u.gid, u.additional_gids.clone())
    }

    #[test]
    fn names_and_numbers_resolve_like_docker() {
        let r = |s: &str| resolve(s, Some(PASSWD), Some(GROUP)).map(|u| ids(&u));
        assert_eq!(r(""), Ok((0, 0, vec![])));
        assert_eq!(r("root"), Ok((0, 0, vec![])));
        assert_eq!(r("nginx"), Ok((101, 101, vec![33])));
        assert_eq!(r("app"), Ok((1000, 1000, vec![4, 33])));
        // A number finds its entry; an unknown one gets group 0.
        assert_eq!(r("1000"), Ok((1000, 1000, vec![4, 33])));
        assert_eq!(r("4242"), Ok((4242, 0, vec![])));
        // An explicit group: no supplementary groups.
        assert_eq!(r("app:www"), Ok((1000, 33, vec![])));
        assert_eq!(r("nginx:7"), Ok((101, 7, vec![])));
        assert_eq!(r("5:6"), Ok((5, 6, vec![])));
        assert!(r("ghost").unwrap_err().contains("ghost"));
        assert!(r("app:ghosts").unwrap_err().contains("ghosts"));
    }

    #[test]
    fn images_without_passwd_take_numbers_only() {
        assert_eq!(
            ids(&resolve("1000", None, None).unwrap()),
            (1000, 0, vec![])
        );
        assert!(resolve("nginx", None, None).is_err());
        // Garbage lines are skipped.
        let u = resolve(
            "a",
            Some("::\nnot a line\na:x:7:8::/:/bin/sh\n"),
            Some("g:x:zz:a\n"),
        )
        .unwrap();
        assert_eq!(ids(&u), (7, 8, vec![]));
    }
}
