//! How a context is built (BLD-4) and for which platforms (BLD-7).

use std::path::{Path, PathBuf};

/// Where the Dockerfile comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// The context's own `Dockerfile`.
    Dockerfile,
    /// The nixpacks planner writes `.nixpacks/Dockerfile` first.
    Nixpacks,
}

impl Strategy {
    /// A root entry named exactly `Dockerfile` that is not a directory means
    /// the Dockerfile strategy; anything else (a directory of that name, a
    /// lowercase `dockerfile`, an empty tree) means nixpacks.
    pub fn detect(context: &Path) -> Self {
        match std::fs::symlink_metadata(context.join("Dockerfile")) {
            Ok(meta) if !meta.is_dir() => Self::Dockerfile,
            _ => Self::Nixpacks,
        }
    }

    /// The Dockerfile, relative to the context.
    pub fn dockerfile(self) -> PathBuf {
        match self {
            Self::Dockerfile => PathBuf::from("Dockerfile"),
            Self::Nixpacks => PathBuf::from(".nixpacks/Dockerfile"),
        }
    }
}

/// `linux/<arch>` of this binary, in OCI spelling.
pub fn native_platform() -> String {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "arm" => "arm",
        "powerpc64" => "ppc64le",
        "s390x" => "s390x",
        "riscv64" => "riscv64",
        other => other,
    };
    format!("linux/{arch}")
}

/// The requested platforms, or `[native]` when none are.
pub fn resolve_platforms(requested: &[String]) -> Vec<String> {
    let given: Vec<String> = requested
        .iter()
        .map(|p| p.trim().to_owned())
        .filter(|p| !p.is_empty())
        .collect();
    if given.is_empty() {
        vec![native_platform()]
    } else {
        given
    }
}

/// The platforms that are not exactly the native one.
pub fn needing_emulation<'a>(platforms: &'a [String], native: &str) -> Vec<&'a str> {
    platforms
        .iter()
        .map(String::as_str)
        .filter(|p| *p != native)
        .collect()
}

/// The qemu binfmt_misc handler name of an OCI platform (`linux/arm64` is
/// `qemu-aarch64`).
fn qemu_handler(platform: &str) -> Option<&'static str> {
    let arch = platform.strip_prefix("linux/")?;
    Some(match arch.split('/').next()? {
        "amd64" => "qemu-x86_64",
        "arm64" => "qemu-aarch64",
        "arm" => "qemu-arm",
        "386" => "qemu-i386",
        "ppc64le" => "qemu-ppc64le",
        "s390x" => "qemu-s390x",
        "riscv64" => "qemu-riscv64",
        "mips64le" => "qemu-mips64el",
        _ => return None,
    })
}

/// The first platform without an enabled emulator under `binfmt_misc`
/// (normally `/proc/sys/fs/binfmt_misc`), read now: handlers come and go
/// with the host's configuration, so nothing is remembered.
pub fn missing_emulator<'a>(needed: &[&'a str], binfmt_misc: &Path) -> Option<&'a str> {
    needed.iter().copied().find(|platform| {
        let Some(handler) = qemu_handler(platform) else {
            return true;
        };
        std::fs::read_to_string(binfmt_misc.join(handler)).map_or(true, |text| {
            text.lines().next().is_none_or(|l| l.trim() != "enabled")
        })
    })
}

/// The platforms this node can build for now: its own, then each one whose
/// qemu handler is enabled under `binfmt_misc` (BLD-7).
pub fn serveable_platforms(binfmt_misc: &Path) -> Vec<String> {
    const KNOWN: [&str; 8] = [
        "linux/amd64",
        "linux/arm64",
        "linux/arm",
        "linux/386",
        "linux/ppc64le",
        "linux/s390x",
        "linux/riscv64",
        "linux/mips64le",
    ];
    let native = native_platform();
    let mut out = vec![native.clone()];
    out.extend(
        KNOWN
            .into_iter()
            .filter(|p| *p != native && missing_emulator(&[p], binfmt_misc).is_none())
            .map(str::to_owned),
    );
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::disallowed_methods)]
    use super::*;

    #[test]
    fn the_strategy_follows_a_root_dockerfile_file_only() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            Strategy::detect(dir.path()),
            Strategy::Nixpacks,
            "empty tree"
        );
        std::fs::write(dir.path().join("package.json"), "{}").unwrap();
        assert_eq!(Strategy::detect(dir.path()), Strategy::Nixpacks);
        std::fs::write(dir.path().join("dockerfile"), "FROM x").unwrap();
        assert_eq!(
            Strategy::detect(dir.path()),
            Strategy::Nixpacks,
            "lowercase"
        );
        std::fs::create_dir(dir.path().join("Dockerfile")).unwrap();
        assert_eq!(
            Strategy::detect(dir.path()),
            Strategy::Nixpacks,
            "a directory"
        );
        std::fs::remove_dir(dir.path().join("Dockerfile")).unwrap();
        std::fs::write(dir.path().join("Dockerfile"), "FROM x").unwrap();
        assert_eq!(Strategy::detect(dir.path()), Strategy::Dockerfile);
        assert_eq!(
            Strategy::Nixpacks.dockerfile(),
            Path::new(".nixpacks/Dockerfile")
        );
    }

    #[test]
    fn platforms_resolve_to_native_and_only_others_need_emulation() {
        let native = native_platform();
        assert_eq!(resolve_platforms(&[]), vec![native.clone()]);
        let both = vec!["linux/amd64".to_owned(), "linux/arm64".to_owned()];
        assert_eq!(resolve_platforms(&both), both);
        assert_eq!(needing_emulation(&both, "linux/amd64"), vec!["linux/arm64"]);
        assert!(needing_emulation(std::slice::from_ref(&native), &native).is_empty());
    }

    #[test]
    fn serveable_platforms_are_the_native_one_and_the_emulated_ones() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(serveable_platforms(dir.path()), [native_platform()]);
        let other = if native_platform() == "linux/arm64" {
            ("qemu-x86_64", "linux/amd64")
        } else {
            ("qemu-aarch64", "linux/arm64")
        };
        std::fs::write(
            dir.path().join(other.0),
            "enabled\ninterpreter /usr/bin/q\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("qemu-s390x"), "disabled\n").unwrap();
        assert_eq!(
            serveable_platforms(dir.path()),
            [native_platform(), other.1.to_owned()]
        );
    }

    #[test]
    fn emulators_are_read_from_binfmt_misc() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            missing_emulator(&["linux/arm64"], dir.path()),
            Some("linux/arm64")
        );
        std::fs::write(
            dir.path().join("qemu-aarch64"),
            "enabled\ninterpreter /usr/bin/qemu-aarch64-static\nflags: F\n",
        )
        .unwrap();
        assert_eq!(missing_emulator(&["linux/arm64"], dir.path()), None);
        std::fs::write(dir.path().join("qemu-aarch64"), "disabled\n").unwrap();
        assert!(missing_emulator(&["linux/arm64"], dir.path()).is_some());
        assert_eq!(
            missing_emulator(&["plan9/vax"], dir.path()),
            Some("plan9/vax")
        );
    }
}
