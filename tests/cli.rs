//! The `zattera-agent` binary's behaviour at its edges: version, and one clear
//! line (no panic) when containerd or the config is not there.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

use std::process::Command;

fn agent() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_zattera-agent"));
    cmd.env_remove("RUST_LOG").env_remove("ZATTERA_RUN_DIR");
    cmd
}

/// Runs `image import` against containerd at `socket`; asserts it fails
/// with one line of stderr and returns that line.
fn import_fails_in_one_line(socket: &std::path::Path) -> String {
    let out = agent()
        .args(["--config", "/dev/null", "--containerd-address"])
        .arg(socket)
        .args(["image", "import", "whatever.tar"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    stderr
}

#[test]
fn version_prints_the_crate_version() {
    let out = agent().arg("version").output().unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("zattera-agent {}\n", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn missing_containerd_socket_is_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("containerd.sock");
    let stderr = import_fails_in_one_line(&socket);
    assert!(stderr.contains(&socket.display().to_string()), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn refused_socket_is_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("dead.sock");
    // A socket file nobody listens on: bound, then the listener is dropped.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    let stderr = import_fails_in_one_line(&socket);
    assert!(
        stderr.contains("dead.sock") && stderr.contains("refused"),
        "{stderr}"
    );
}

#[test]
fn unknown_config_key_names_key_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("agent.toml");
    std::fs::write(
        &config,
        "namespace = \"x\"\ncontainerd-adress = \"/run/c.sock\"\n",
    )
    .unwrap();
    let out = agent()
        .arg("--config")
        .arg(&config)
        .args(["image", "import", "x.tar"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("agent.toml") && stderr.contains("containerd-adress"),
        "{stderr}"
    );
}

mod support;

/// `doctor --json` with `args` (global flags); exit success and the checks by name.
fn doctor(args: &[&std::ffi::OsStr]) -> (bool, serde_json::Value) {
    let out = agent()
        .args(args)
        .args(["doctor", "--json"])
        .output()
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    assert_eq!(report["ok"].as_bool().unwrap(), out.status.success());
    (out.status.success(), report)
}

fn check<'a>(report: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no {name} check: {report}"))
}

#[test]
fn doctor_passes_against_the_rig() {
    let Some(rig) = support::rig() else { return };
    let data = tempfile::tempdir().unwrap();
    let (ok, report) = doctor(&[
        "--config".as_ref(),
        "/dev/null".as_ref(),
        "--containerd-address".as_ref(),
        rig.socket.as_os_str(),
        "--data-dir".as_ref(),
        data.path().as_os_str(),
    ]);
    assert!(ok, "{report:#}");
    let ctd = check(&report, "containerd");
    assert_eq!(ctd["verdict"], "pass");
    assert!(ctd["detail"].as_str().unwrap().starts_with("1."), "{ctd}");
    for name in [
        "config",
        "root",
        "runc",
        "overlayfs",
        "cgroups",
        "nftables",
        "netns",
        "forwarding",
        "disk",
        "wireguard",
    ] {
        assert_ne!(
            check(&report, name)["verdict"],
            "fail",
            "{name}: {report:#}"
        );
    }
    // BLD-7: the platforms builds can target, this machine's first.
    let platforms = check(&report, "build platforms")["detail"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(platforms.starts_with("linux/"), "{platforms}");
    // The plain form: one line per check.
    let out = agent()
        .args(["--config", "/dev/null", "--containerd-address"])
        .arg(&rig.socket)
        .arg("doctor")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    // One line per check the JSON form reports (the set grows with the
    // node's capabilities, so the count is the report's, not a constant).
    let checks = report["checks"].as_array().unwrap().len();
    assert_eq!(text.lines().count(), checks, "{text}");
    assert!(
        text.lines()
            .all(|l| l.starts_with("PASS ") || l.starts_with("WARN ")),
        "{text}"
    );
}

#[test]
fn doctor_names_a_missing_socket_and_a_bad_config() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nope.sock");
    let (ok, report) = doctor(&[
        "--config".as_ref(),
        "/dev/null".as_ref(),
        "--containerd-address".as_ref(),
        socket.as_os_str(),
    ]);
    assert!(!ok);
    let c = check(&report, "containerd");
    assert_eq!(c["verdict"], "fail");
    assert!(c["detail"].as_str().unwrap().contains("nope.sock"), "{c}");
    assert!(c["fix"].as_str().unwrap().contains("systemctl"), "{c}");

    // An unreadable config file (a directory), and one that does not parse.
    for (bad, needle) in [
        (dir.path().to_path_buf(), dir.path().display().to_string()),
        (dir.path().join("bad.toml"), "data-dri".to_owned()),
    ] {
        std::fs::write(dir.path().join("bad.toml"), "data-dri = \"/x\"\n").unwrap();
        let (ok, report) = doctor(&["--config".as_ref(), bad.as_os_str()]);
        assert!(!ok);
        let c = check(&report, "config");
        assert_eq!(c["verdict"], "fail", "{report:#}");
        assert!(c["detail"].as_str().unwrap().contains(&needle), "{c}");
    }
}

/// A full data dir (a small tmpfs filled up) fails doctor's disk check.
#[test]
fn doctor_names_a_full_data_disk() {
    if !zattera_testkit::require_root() {
        return; // mounts a tmpfs
    }
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("data");
    std::fs::create_dir(&mnt).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"])
        .arg(&mnt)
        .status()
        .unwrap()
        .success();
    assert!(mounted);
    let fill = Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}/fill", mnt.display()))
        .args(["bs=1M", "count=8"])
        .output()
        .unwrap();
    assert!(!fill.status.success(), "8 MiB into a 4 MiB tmpfs: {fill:?}");
    let (ok, report) = doctor(&[
        "--config".as_ref(),
        "/dev/null".as_ref(),
        "--data-dir".as_ref(),
        mnt.as_os_str(),
    ]);
    let _ = Command::new("umount").arg(&mnt).status();
    assert!(!ok);
    let c = check(&report, "disk");
    assert_eq!(c["verdict"], "fail", "{report:#}");
    assert!(c["detail"].as_str().unwrap().starts_with("0 B free"), "{c}");
}
