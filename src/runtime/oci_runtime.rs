//! Which OCI runtime containerd's runc shim runs for the node's containers:
//! runc (the shim's own default, found on containerd's PATH) or another
//! runc-compatible binary such as crun, named in the shim's `BinaryName`
//! option on each container. The shim, its groups, exec, OOM events and
//! the cgroup layout stay the same; only the program that makes and
//! execs into the container changes.

use std::path::{Path, PathBuf};

/// `containerd.runc.v1.Options`, the runc shim's options: only the field
/// the agent sets (the binary); the others keep the shim's defaults.
#[derive(Clone, PartialEq, prost::Message)]
struct RuncOptions {
    #[prost(string, tag = "6")]
    binary_name: String,
}

/// The type URL the runc shim decodes its options by (containerd 1.6 to 2.x).
const RUNC_OPTIONS_TYPE_URL: &str = "containerd.runc.v1.Options";

/// What the host offers a runtime.
#[derive(Debug, Clone, Copy)]
pub struct Host {
    /// Finds a program the way a shell does.
    pub on_path: fn(&str) -> Option<PathBuf>,
    /// `/sys/fs/cgroup` is cgroup v2 alone (no v1 hierarchy beside it).
    pub cgroup_v2_only: bool,
}

impl Host {
    /// This machine.
    pub fn this_one() -> Self {
        Self {
            on_path: crate::programs::on_path,
            cgroup_v2_only: Path::new("/sys/fs/cgroup/cgroup.controllers").exists(),
        }
    }
}

/// The runtime the node's containers run with.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum OciRuntime {
    /// runc, as the shim finds it: no option at all.
    #[default]
    Runc,
    /// Another runc-compatible binary, by absolute path.
    Binary { name: String, path: PathBuf },
}

impl OciRuntime {
    /// The setting `oci-runtime`: `runc`, `crun`, `auto` (crun when it is
    /// installed and the host's cgroups are v2 only, else runc) or an
    /// absolute path. `host` says what the host has.
    pub fn resolve(setting: &str, host: &Host) -> Result<Self, String> {
        let on_path = host.on_path;
        match setting.trim() {
            "" | "runc" => Ok(Self::Runc),
            "auto" if !host.cgroup_v2_only => Ok(Self::Runc),
            "auto" => Ok(on_path("crun").map_or(Self::Runc, |path| Self::Binary {
                name: "crun".to_owned(),
                path,
            })),
            // crun refuses a host that mounts cgroup v1 and v2 side by side
            // ("cgroups in hybrid mode not supported"): every start would
            // fail with it, so the agent says so before it starts.
            "crun" if !host.cgroup_v2_only => Err(
                "crun runs only where the host's cgroups are v2 only (this host mounts v1 and v2 \
                 side by side, which crun refuses); say runc"
                    .to_owned(),
            ),
            "crun" => on_path("crun")
                .map(|path| Self::Binary {
                    name: "crun".to_owned(),
                    path,
                })
                .ok_or_else(|| {
                    "crun is not on PATH (install it: apt install crun), or say runc".to_owned()
                }),
            other if Path::new(other).is_absolute() => {
                let path = PathBuf::from(other);
                if !path.is_file() {
                    return Err(format!("{other}: no such file"));
                }
                let name = path
                    .file_name()
                    .map_or_else(|| other.to_owned(), |n| n.to_string_lossy().into_owned());
                Ok(Self::Binary { name, path })
            }
            other => Err(format!(
                "{other:?}: say runc, crun, auto, or an absolute path to a runc-compatible runtime"
            )),
        }
    }

    /// Its name, as `doctor` and the logs say it.
    pub fn name(&self) -> &str {
        match self {
            Self::Runc => "runc",
            Self::Binary { name, .. } => name,
        }
    }

    /// The binary, when it is not the shim's default.
    pub fn binary(&self) -> Option<&Path> {
        match self {
            Self::Runc => None,
            Self::Binary { path, .. } => Some(path),
        }
    }

    /// The shim options a container is created with; `None` for runc.
    pub fn shim_options(&self) -> Option<prost_types::Any> {
        let path = self.binary()?;
        Some(prost_types::Any {
            type_url: RUNC_OPTIONS_TYPE_URL.to_owned(),
            value: prost::Message::encode_to_vec(&RuncOptions {
                binary_name: path.to_string_lossy().into_owned(),
            }),
        })
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn with_crun(name: &str) -> Option<PathBuf> {
        (name == "crun").then(|| PathBuf::from("/usr/bin/crun"))
    }

    fn without(_: &str) -> Option<PathBuf> {
        None
    }

    fn host(crun: bool, cgroup_v2_only: bool) -> Host {
        Host {
            on_path: if crun { with_crun } else { without },
            cgroup_v2_only,
        }
    }

    #[test]
    fn each_setting_resolves_as_documented() {
        let v2 = host(true, true);
        assert_eq!(OciRuntime::resolve("runc", &v2), Ok(OciRuntime::Runc));
        assert_eq!(OciRuntime::resolve("", &v2), Ok(OciRuntime::Runc));
        let crun = OciRuntime::Binary {
            name: "crun".into(),
            path: "/usr/bin/crun".into(),
        };
        assert_eq!(OciRuntime::resolve("crun", &v2), Ok(crun.clone()));
        assert_eq!(OciRuntime::resolve("auto", &v2), Ok(crun));
        assert_eq!(
            OciRuntime::resolve("auto", &host(false, true)),
            Ok(OciRuntime::Runc)
        );
        let missing = OciRuntime::resolve("crun", &host(false, true)).unwrap_err();
        assert!(missing.contains("apt install crun"), "{missing}");
        let bad = OciRuntime::resolve("youki", &v2).unwrap_err();
        assert!(bad.contains("say runc, crun, auto"), "{bad}");
        let absent = OciRuntime::resolve("/nonexistent/crun", &v2).unwrap_err();
        assert!(absent.contains("no such file"), "{absent}");
    }

    #[test]
    fn a_hybrid_cgroup_host_keeps_runc_and_refuses_crun_up_front() {
        let hybrid = host(true, false);
        assert_eq!(OciRuntime::resolve("auto", &hybrid), Ok(OciRuntime::Runc));
        let refused = OciRuntime::resolve("crun", &hybrid).unwrap_err();
        assert!(refused.contains("cgroups are v2 only"), "{refused}");
    }

    #[test]
    fn runc_sets_no_option_and_another_binary_names_its_path() {
        assert_eq!(OciRuntime::Runc.shim_options(), None);
        let any = OciRuntime::Binary {
            name: "crun".into(),
            path: "/usr/bin/crun".into(),
        }
        .shim_options()
        .unwrap();
        assert_eq!(any.type_url, "containerd.runc.v1.Options");
        // Field 6, length-delimited, then the path: what the shim decodes.
        let mut want = vec![6 << 3 | 2, 13];
        want.extend_from_slice(b"/usr/bin/crun");
        assert_eq!(any.value, want);
    }
}
