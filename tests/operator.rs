//! The operator CLI over the admin socket (issue 17.5): `logs` (tail,
//! follow), `top`, `stats` and `images` against a real standalone agent,
//! each TARGET form included.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod support;

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::agent::{AgentProc, BIN};
use support::{TEST_IMAGE, on_rig_with_image};

fn cli(agent: &AgentProc, args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(["--config", "/dev/null", "--run-dir"])
        .arg(agent.run_dir())
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

fn ok(out: &std::process::Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn logs_top_stats_and_images_answer_from_the_running_agent() {
    on_rig_with_image("operator", |ctd, rig| async move {
        let mut agent = AgentProc::new(&rig.socket, ctd.namespace().as_str(), "ztle", "234-234");
        agent.write_manifest(
            "talk.toml",
            &support::agent::app_manifest(
                "talk",
                "i=0; while true; do echo line $i; echo oops $i >&2; i=$((i+1)); sleep 0.2; done",
            ),
        );
        agent.start();
        let ids = agent.wait_all(1, "HEALTHY");
        let (assignment, cid) = ids.into_iter().next().unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;

        // logs: the newest lines, stdout and stderr apart, by every TARGET form.
        for target in [assignment.as_str(), cid.as_str(), "talk.prod.p"] {
            let out = cli(&agent, &["logs", target, "--tail", "4"]);
            let stdout = ok(&out);
            let lines: Vec<&str> = stdout.lines().collect();
            assert!(!lines.is_empty() && lines.len() <= 4, "{target}: {lines:?}");
            assert!(lines.iter().all(|l| l.starts_with("line ")), "{lines:?}");
            assert!(
                String::from_utf8_lossy(&out.stderr).contains("oops "),
                "{out:?}"
            );
        }
        let all = ok(&cli(&agent, &["logs", "talk.prod.p"]));
        assert!(all.starts_with("line 0\n"), "{all}");
        let recent = ok(&cli(&agent, &["logs", "talk.prod.p", "--since", "1s"]));
        assert!(
            recent.lines().count() < all.lines().count(),
            "--since kept everything"
        );
        let nobody = cli(&agent, &["logs", "nobody"]);
        assert!(!nobody.status.success());
        assert!(
            String::from_utf8_lossy(&nobody.stderr).contains("talk.prod.p"),
            "{nobody:?}"
        );

        // logs -f: new lines keep coming.
        let mut follow = Command::new(BIN)
            .args(["--config", "/dev/null", "--run-dir"])
            .arg(agent.run_dir())
            .args(["logs", "-f", "--tail", "1", "talk.prod.p"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut reader = std::io::BufReader::new(follow.stdout.take().unwrap());
        let number = |l: &str| {
            l.trim()
                .strip_prefix("line ")
                .and_then(|n| n.parse::<u64>().ok())
        };
        let mut first = String::new();
        reader.read_line(&mut first).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut seen = Vec::new();
        while seen.len() < 3 && Instant::now() < deadline {
            let mut l = String::new();
            reader.read_line(&mut l).unwrap();
            seen.push(number(&l).unwrap());
        }
        let _ = follow.kill();
        let _ = follow.wait();
        let start = number(&first).unwrap();
        assert_eq!(seen, [start + 1, start + 2, start + 3], "follow");

        // top: the shell and its sleep.
        let top = ok(&cli(&agent, &["top", "talk.prod.p"]));
        assert!(top.lines().next().unwrap().contains("PID"), "{top}");
        assert!(top.contains("sh -c"), "{top}");

        // stats: the instance, with memory.
        let stats: serde_json::Value =
            serde_json::from_str(&ok(&cli(&agent, &["stats", "--json"]))).unwrap();
        let row = &stats.as_array().unwrap()[0];
        assert_eq!(row["id"], assignment.as_str());
        assert!(row["memory_bytes"].as_u64().unwrap() > 0, "{row}");
        let table = ok(&cli(&agent, &["stats", "talk.prod.p"]));
        assert!(
            table.starts_with("INSTANCE") && table.contains(&assignment),
            "{table}"
        );

        // images: the one in use, its size and its user.
        let images: serde_json::Value =
            serde_json::from_str(&ok(&cli(&agent, &["images", "--json"]))).unwrap();
        let image = images
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["name"] == TEST_IMAGE)
            .unwrap_or_else(|| panic!("{images}"));
        assert!(image["size_bytes"].as_u64().unwrap() > 100_000, "{image}");
        assert_eq!(image["users"], serde_json::json!([cid]));
        assert_eq!(image["owned"], true);
        assert!(ok(&cli(&agent, &["images"])).starts_with("IMAGE"));

        // exec: both streams apart and the exit code passed through.
        let out = cli(
            &agent,
            &[
                "exec",
                "talk.prod.p",
                "--",
                "sh",
                "-c",
                "echo hi; echo err >&2; exit 3",
            ],
        );
        assert_eq!(out.status.code(), Some(3), "{out:?}");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\n");
        assert_eq!(String::from_utf8_lossy(&out.stderr), "err\n");
        // exec -i: stdin reaches the process, and its end ends it.
        let mut cat = Command::new(BIN)
            .args(["--config", "/dev/null", "--run-dir"])
            .arg(agent.run_dir())
            .args(["exec", "-i", &assignment, "--", "cat"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(&mut cat.stdin.take().unwrap(), b"through stdin\n").unwrap();
        let out = cat.wait_with_output().unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "through stdin\n");
        exec_it_in_tmux(&agent);

        agent.kill9();
        support::purge_namespace(&ctd).await;
    })
    .await;
}

/// `exec -it` in a tmux pane: `stty size` is the pane's size, a resize
/// reaches the process, and `exit 3` is the command's exit code.
fn exec_it_in_tmux(agent: &AgentProc) {
    let server = format!("zt-test-{}", std::process::id());
    let tmux = |args: &[&str]| {
        let out = Command::new("tmux")
            .args(["-L", &server])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "tmux {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let code_file = agent.run_dir().join("exec-code");
    let command = format!(
        "{BIN} --config /dev/null --run-dir {} exec -it talk.prod.p -- sh; echo EXIT=$? > {}; sleep 60",
        agent.run_dir().display(),
        code_file.display()
    );
    tmux(&[
        "new-session",
        "-d",
        "-s",
        "zt",
        "-x",
        "100",
        "-y",
        "30",
        &command,
    ]);
    let pane = |want: &str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = tmux(&["capture-pane", "-p", "-t", "zt"]);
            if text.contains(want) {
                return text;
            }
            assert!(
                Instant::now() < deadline,
                "no {want:?} in the pane:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    tmux(&["send-keys", "-t", "zt", "stty size", "Enter"]);
    pane("30 100");
    tmux(&["resize-window", "-t", "zt", "-x", "120", "-y", "40"]);
    std::thread::sleep(Duration::from_millis(500));
    tmux(&["send-keys", "-t", "zt", "clear; stty size", "Enter"]);
    pane("40 120");
    tmux(&["send-keys", "-t", "zt", "exit 3", "Enter"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !code_file.exists() {
        assert!(Instant::now() < deadline, "exec -it did not end");
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = Command::new("tmux")
        .args(["-L", &server, "kill-server"])
        .output();
    assert_eq!(
        std::fs::read_to_string(&code_file).unwrap().trim(),
        "EXIT=3"
    );
}
