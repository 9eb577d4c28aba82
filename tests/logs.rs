//! Container output kept as promised (issue 17.1), through the real
//! `zattera-agent run` binary, its log shim under containerd's runc shim and
//! the rig's containerd: a heavy writer loses no line, rotated files are
//! zstd-compressed and within the cap, QueryLogs reads across compressed and
//! live files in order, and the janitor removes what retention says.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod support;

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;
use support::agent::AgentProc;
use support::{Rig, on_rig};
use zattera_agent::logs::files::{self, Kind};
use zattera_agent::proto::v1::{LogQuery, LogSelector};
use zattera_agent::runtime::{Containerd, import_archive};

const TOOLS: &str = "docker.io/zattera/busybox:tools";
const DAY: Duration = Duration::from_secs(24 * 3600);

/// Imports the tools image and makes an agent (not started) for `ctd`'s
/// namespace, with bridge prefix `prefix` and subnet slots `pool`.
async fn tools_agent(ctd: &Containerd, rig: &Rig, prefix: &str, pool: &str) -> AgentProc {
    import_archive(ctd, &rig.images.join("tools-oci.tar"), None)
        .await
        .unwrap();
    AgentProc::new(&rig.socket, ctd.namespace().as_str(), prefix, pool)
}

/// Kills `agent` and purges its namespace.
async fn kill_and_purge(mut agent: AgentProc, ctd: &Containerd) {
    agent.kill9();
    support::purge_namespace(ctd).await;
}

/// Every line `query` finds in `agent`'s logs (with no desired set).
async fn query_all(
    ctd: &Containerd,
    agent: &AgentProc,
    query: LogQuery,
) -> Vec<zattera_agent::proto::v1::LogLine> {
    let (_, desired) = tokio::sync::watch::channel(None);
    let mut got = zattera_agent::logs::query::query_logs(ctd, &agent.data_dir(), &desired, query)
        .await
        .unwrap();
    let mut lines = Vec::new();
    while let Some(l) = got.next().await {
        lines.push(l);
    }
    lines
}

fn spewer(mib_per_sec: u32, secs: u32) -> String {
    format!(
        "[app]\nname = \"spew\"\nproject = \"p\"\n[build]\ntype = \"image\"\nimage = \"{TOOLS}\"\n\
         [env.prod]\ncommand = \"ztprobe spew {mib_per_sec} {secs}; exec sleep 1000000\"\n"
    )
}

/// The CRI text of every line in `paths`, in order.
fn texts(paths: &[PathBuf]) -> Vec<String> {
    let mut out = Vec::new();
    for p in paths {
        for line in files::open(p).unwrap().lines() {
            let line = line.unwrap();
            out.push(line.splitn(4, ' ').nth(3).unwrap_or_default().to_owned());
        }
    }
    out
}

/// Every line of one file: its time and its text.
fn texts_with_time(path: &Path) -> Vec<(SystemTime, String)> {
    files::open(path)
        .unwrap()
        .lines()
        .map(|l| {
            let l = l.unwrap();
            let mut parts = l.splitn(4, ' ');
            let time = humantime::parse_rfc3339(parts.next().unwrap()).unwrap();
            (time, parts.nth(2).unwrap_or_default().to_owned())
        })
        .collect()
}

/// Where a line stands in the spewer's output: `spew <n>` is n, and the
/// closing `spew end <count>` comes right after the last one.
fn position(text: &str) -> Option<u64> {
    spew_number(text).or_else(|| text.strip_prefix("spew end ")?.parse().ok())
}

/// `spew <n>` → n; `spew end <count>` → None.
fn spew_number(text: &str) -> Option<u64> {
    text.strip_prefix("spew ")?.split(' ').next()?.parse().ok()
}

/// Waits until the spewer's last line is in the live file and every
/// rotation is compressed; the container's files then.
fn wait_for_the_end(live: &Path, within: Duration) -> Vec<files::LogFile> {
    let deadline = Instant::now() + within;
    loop {
        let ended = std::fs::read_to_string(live).is_ok_and(|t| t.contains(" spew end "));
        let mine = files::list_container(live);
        let pending = mine
            .iter()
            .any(|f| matches!(f.kind, Kind::Raw(_) | Kind::Partial(_)));
        if ended && !pending {
            return mine;
        }
        assert!(
            Instant::now() < deadline,
            "the spewer did not finish: ended {ended}, rotations pending {pending}: {mine:#?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// `zattera-agent logs -f` of the container until the spewer's last line:
/// the numbers it printed.
fn follow_to_the_end(agent: &AgentProc, cid: &str) -> std::thread::JoinHandle<Vec<u64>> {
    let mut child = std::process::Command::new(support::agent::BIN)
        .args(["--config", "/dev/null", "--run-dir"])
        .arg(agent.run_dir())
        .args(["logs", "-f", "--tail", "1", cid])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        let mut seen = Vec::new();
        for line in std::io::BufReader::new(out).lines() {
            let line = line.unwrap();
            if line.starts_with("spew end ") {
                break;
            }
            seen.push(spew_number(&line).unwrap());
        }
        let _ = child.kill();
        let _ = child.wait();
        seen
    })
}

fn age(path: &Path, by: Duration) {
    std::fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(SystemTime::now() - by)
        .unwrap();
}

#[tokio::test]
async fn a_heavy_writer_loses_no_line_and_retention_is_kept() {
    on_rig("logs-heavy", |ctd, rig| async move {
        let mut agent = tools_agent(&ctd, &rig, "ztla", "230-230").await;
        agent.write_manifest("spew.toml", &spewer(20, 30));
        agent.start();
        let ids = agent.wait_all(1, "HEALTHY");
        let (assignment, cid) = ids.into_iter().next().unwrap();
        let started = Instant::now();
        let live = agent.data_dir().join("logs").join(format!("{cid}.log"));
        let mine = wait_for_the_end(&live, Duration::from_secs(120));
        let took = started.elapsed();

        // Every line, once, in order, across compressed rotations.
        let paths = files::of_container(&live);
        let all = texts(&paths);
        let (last, numbers) = all.split_last().unwrap();
        for (want, text) in numbers.iter().enumerate() {
            assert_eq!(
                spew_number(text),
                Some(want as u64),
                "line {want}: {text:?}"
            );
        }
        assert_eq!(last, &format!("spew end {}", numbers.len()));
        let compressed: Vec<&files::LogFile> = mine
            .iter()
            .filter(|f| matches!(f.kind, Kind::Compressed(_)))
            .collect();
        let zst_bytes: u64 = compressed.iter().map(|f| f.size).sum();
        let raw_bytes = numbers.len() as u64 * 100;
        eprintln!(
            "{} lines ({} MiB) in {:.1} s, {} compressed rotations, {} KiB compressed",
            numbers.len(),
            raw_bytes >> 20,
            took.as_secs_f64(),
            compressed.len(),
            zst_bytes >> 10
        );
        // 20 MiB/s for 30 s is about 600 MiB, 8 MiB a rotation.
        assert!(numbers.len() > 5_000_000, "{} lines", numbers.len());
        assert!(compressed.len() >= 50, "{} rotations", compressed.len());
        assert!(zst_bytes <= 100 << 20, "{zst_bytes} bytes over the cap");

        // QueryLogs from the newest compressed file's last line to the live
        // file's first (each a read of the shim, a few hundred lines that
        // share a time): one run of lines, out of the .zst and on into the
        // live file without a gap.
        let newest_zst = &compressed.last().unwrap().path;
        let zst_last = texts_with_time(newest_zst).pop().unwrap();
        let live_first = texts_with_time(&live).into_iter().next().unwrap();
        let query = LogQuery {
            selector: Some(LogSelector {
                instance_id: assignment.clone(),
                ..LogSelector::default()
            }),
            since: Some(zst_last.0.into()),
            until: Some(live_first.0.into()),
            limit: 10_000,
            ..LogQuery::default()
        };
        let lines = query_all(&ctd, &agent, query).await;
        assert!(
            lines.len() < 10_000,
            "{} lines: a read is far smaller",
            lines.len()
        );
        assert!(lines.iter().all(|l| l.instance_id == assignment));
        let ns: Vec<u64> = lines.iter().map(|l| position(&l.line).unwrap()).collect();
        assert!(
            ns.windows(2).all(|w| w[1] == w[0] + 1),
            "a gap or reordering"
        );
        let (zst_n, live_n) = (
            position(&zst_last.1).unwrap(),
            position(&live_first.1).unwrap(),
        );
        assert_eq!(
            live_n,
            zst_n + 1,
            "the live file goes on from the newest rotation"
        );
        assert!(
            ns.contains(&zst_n) && ns.contains(&live_n),
            "{}..={} does not cross from {zst_n} into {live_n}",
            ns[0],
            ns[ns.len() - 1]
        );

        // The janitor, at the agent's start: a rotation past the age cap
        // goes; so does every file of a container removed 8 days ago, but
        // not those of one removed yesterday, nor the running one's.
        agent.kill9();
        let logs = agent.data_dir().join("logs");
        let oldest = compressed[0].path.clone();
        age(&oldest, 8 * DAY);
        let gone = |cid: &str, ago: Duration| -> Vec<PathBuf> {
            let live = logs.join(format!("{cid}.log"));
            std::fs::write(&live, "2026-11-20T00:00:00Z stdout F bye\n").unwrap();
            files::write_meta(
                &live,
                &files::StreamMeta {
                    assignment_id: format!("{cid}-assignment"),
                    ..Default::default()
                },
            )
            .unwrap();
            let rotated = files::rotated(&live, 1);
            std::fs::write(&rotated, "2026-11-20T00:00:00Z stdout F hi\n").unwrap();
            let (rotated, _) = files::compress(&rotated).unwrap();
            let all = vec![live.clone(), files::meta_path(&live), rotated];
            for p in &all {
                age(p, ago);
            }
            all
        };
        let old_gone = gone("removed-long-ago", 8 * DAY);
        let recently_gone = gone("removed-yesterday", DAY);
        agent.start();
        let deadline = Instant::now() + Duration::from_secs(30);
        while old_gone.iter().chain([&oldest]).any(|p| p.exists()) {
            assert!(
                Instant::now() < deadline,
                "the janitor left {:?}; agent log:\n{}",
                old_gone
                    .iter()
                    .chain([&oldest])
                    .filter(|p| p.exists())
                    .collect::<Vec<_>>(),
                agent.log()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        for p in recently_gone.iter().chain([&live, &compressed[1].path]) {
            assert!(p.exists(), "{} was removed", p.display());
        }
        assert!(agent.log().contains("log janitor"), "{}", agent.log());
        // The running container was adopted, not restarted.
        assert_eq!(agent.wait_all(1, "HEALTHY").get(&assignment), Some(&cid));

        kill_and_purge(agent, &ctd).await;
    })
    .await;
}

#[tokio::test]
async fn a_stream_over_its_cap_drops_its_oldest_rotations() {
    on_rig("logs-cap", |ctd, rig| async move {
        let mut agent = tools_agent(&ctd, &rig, "ztlb", "231-231").await;
        agent.run_args = vec!["--log-max-stream-mb".into(), "1".into()];
        agent.write_manifest("spew.toml", &spewer(20, 6));
        agent.start();
        let ids = agent.wait_all(1, "HEALTHY");
        let cid = ids.values().next().unwrap().clone();
        let live = agent.data_dir().join("logs").join(format!("{cid}.log"));
        let mine = wait_for_the_end(&live, Duration::from_secs(90));

        let mut seqs: BTreeMap<u64, u64> = BTreeMap::new();
        for f in &mine {
            if let Kind::Compressed(n) = f.kind {
                seqs.insert(n, f.size);
            }
        }
        let total: u64 = seqs.values().sum();
        assert!(total <= 1 << 20, "{total} compressed bytes kept: {seqs:?}");
        assert!(
            seqs.keys().next().is_some_and(|first| *first > 1),
            "nothing was dropped: {seqs:?}"
        );
        // What is kept is the newest part, without a gap up to the end.
        let all = texts(&files::of_container(&live));
        let (last, numbers) = all.split_last().unwrap();
        let first = spew_number(&numbers[0]).unwrap();
        assert!(first > 0);
        for (i, text) in numbers.iter().enumerate() {
            assert_eq!(spew_number(text), Some(first + i as u64), "{text:?}");
        }
        assert_eq!(last, &format!("spew end {}", first + numbers.len() as u64));

        kill_and_purge(agent, &ctd).await;
    })
    .await;
}

/// `zattera-agent logs -f` from the start of a 20 MiB/s writer: every line,
/// in order, across every rotation (several may come between two looks).
#[tokio::test]
async fn logs_follow_reads_every_rotation() {
    on_rig("logs-follow", |ctd, rig| async move {
        let mut agent = tools_agent(&ctd, &rig, "ztlg", "238-238").await;
        agent.write_manifest("spew.toml", &spewer(20, 4));
        agent.start();
        let ids = agent.wait_all(1, "HEALTHY");
        let cid = ids.values().next().unwrap().clone();
        let follow = follow_to_the_end(&agent, &cid);
        let live = agent.data_dir().join("logs").join(format!("{cid}.log"));
        let mine = wait_for_the_end(&live, Duration::from_secs(90));
        let rotations = mine
            .iter()
            .filter(|f| matches!(f.kind, Kind::Compressed(_)))
            .count();
        let followed = follow.join().unwrap();
        eprintln!(
            "logs -f saw {} lines from {:?}, {rotations} rotations",
            followed.len(),
            followed.first()
        );
        assert!(
            followed.windows(2).all(|w| w[1] == w[0] + 1),
            "logs -f lost or reordered lines across rotations"
        );
        assert!(rotations >= 3, "only {rotations} rotations");
        assert!(
            followed.len() > 200_000,
            "only {} lines followed",
            followed.len()
        );

        kill_and_purge(agent, &ctd).await;
    })
    .await;
}

/// 45.3 end to end: a container prints 64 MiB without a newline (stored as
/// the shim's partial chunks, compressing about 1000:1), and one QueryLogs
/// over it stays bounded: the line is cut at 1 MiB with its marker, and the
/// querying process's peak memory grows by a few MiB, not by the line.
#[tokio::test]
async fn a_query_of_a_line_without_end_stays_bounded() {
    on_rig("logs-endless-line", |ctd, rig| async move {
        let mut agent = tools_agent(&ctd, &rig, "ztlq", "206-206").await;
        agent.write_manifest(
            "long.toml",
            &format!(
                "[app]\nname = \"long\"\nproject = \"p\"\n[build]\ntype = \"image\"\nimage = \"{TOOLS}\"\n\
                 [env.prod]\ncommand = \"head -c 67108864 /dev/zero | tr '\\\\0' A; echo; echo after; exec sleep 1000000\"\n"
            ),
        );
        agent.start();
        let ids = agent.wait_all(1, "HEALTHY");
        let (assignment, cid) = ids.into_iter().next().unwrap();
        let live = agent.data_dir().join("logs").join(format!("{cid}.log"));
        let deadline = Instant::now() + Duration::from_secs(120);
        // A file listed may be rotated away before it is opened: skipped,
        // the next look finds it under its new name.
        let ended = || {
            files::of_container(&live).iter().any(|p| {
                files::open(p).is_ok_and(|f| {
                    f.lines()
                        .map_while(Result::ok)
                        .any(|l| l.splitn(4, ' ').nth(3) == Some("after"))
                })
            })
        };
        while !ended() {
            assert!(Instant::now() < deadline, "the writer never finished");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let query = LogQuery {
            selector: Some(LogSelector {
                instance_id: assignment.clone(),
                ..LogSelector::default()
            }),
            limit: 10,
            ..LogQuery::default()
        };
        let before = support::peak_rss();
        let lines: Vec<String> = query_all(&ctd, &agent, query)
            .await
            .into_iter()
            .map(|l| l.line)
            .collect();
        let grew = support::peak_rss().saturating_sub(before);
        eprintln!("peak memory grew {} MiB over the query", grew >> 20);
        let long = lines.iter().find(|l| l.starts_with("AAAA")).unwrap_or_else(|| panic!("no long line: {:?}", lines.iter().map(|l| &l[..l.len().min(40)]).collect::<Vec<_>>()));
        assert!(long.len() < (1 << 20) + 128, "{} bytes", long.len());
        assert!(long.ends_with("more bytes]"), "{}", &long[long.len() - 80..]);
        assert!(lines.iter().any(|l| l == "after"), "the next line starts clean");
        assert!(grew < 32 << 20, "the query's peak memory grew by {} MiB", grew >> 20);
    })
    .await;
}
