//! The `zattera-agent` binary's behaviour at its edges: version, and one clear
//! line (no panic) when containerd or the config is not there.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

fn agent() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_zattera-agent"));
    cmd.env_remove("RUST_LOG").env_remove("ZATTERA_RUN_DIR");
    cmd
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
    let out = agent()
        .args(["--config", "/dev/null", "--containerd-address"])
        .arg(&socket)
        .args(["image", "import", "whatever.tar"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains(&socket.display().to_string()), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn refused_socket_is_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("dead.sock");
    // A socket file nobody listens on: bound, then the listener is dropped.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    let out = agent()
        .args(["--config", "/dev/null", "--containerd-address"])
        .arg(&socket)
        .args(["image", "import", "whatever.tar"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
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
