//! BuildKit's file-sync framing as the agent's DiffCopy sender meets it:
//! the daemon's include and exclude patterns, then whatever packets it
//! sends (length-delimited protobuf, as they come off the stream). No input
//! may panic the sender; a body goes out only for a file id it announced,
//! at most once, every DATA packet carrying that id.
#![no_main]

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::OnceLock;

use bollard_buildkit_proto::fsutil::types::{Packet, packet::PacketType};
use libfuzzer_sys::fuzz_target;
use prost::Message;
use zattera_agent::image_build::buildkit::filesync::{Filter, Sender};

/// A small context: a Dockerfile, an ignore file, files in nested dirs.
fn context() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("zattera-fuzz-filesync-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (path, body) in [
            ("Dockerfile", "FROM scratch\n"),
            (".dockerignore", "*.log\n!keep.log\n"),
            ("a/b/c.txt", "c"),
            ("a/keep.log", "k"),
            ("a/drop.log", "d"),
            ("z.bin", "zzzz"),
        ] {
            let p = dir.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, body).unwrap();
        }
        dir
    })
}

fuzz_target!(|data: &[u8]| {
    // Patterns up to the first NUL, one a line: `+` includes, `-` excludes.
    let (patterns, mut packets) = match data.iter().position(|b| *b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let (mut includes, mut excludes) = (Vec::new(), Vec::new());
    for line in String::from_utf8_lossy(patterns).lines() {
        match line.split_at_checked(1) {
            Some(("+", p)) => includes.push(p.to_owned()),
            Some(("-", p)) => excludes.push(p.to_owned()),
            _ => {}
        }
    }
    let Ok(filter) = Filter::new(&includes, &excludes) else {
        return;
    };
    let (stats, mut sender) = Sender::start(context(), &filter).unwrap();
    assert!(stats.last().is_some_and(|p| p.stat.is_none()), "the walk ends with an empty STAT");
    const GO_MODE_DIR: u32 = 1 << 31;
    let mut unsent: HashSet<u32> = stats
        .iter()
        .enumerate()
        .filter(|(_, p)| p.stat.as_ref().is_some_and(|s| s.mode & GO_MODE_DIR == 0))
        .map(|(i, _)| u32::try_from(i).unwrap())
        .collect();
    while let Ok(p) = Packet::decode_length_delimited(&mut packets) {
        if PacketType::try_from(p.r#type) != Ok(PacketType::PacketReq) {
            continue;
        }
        let mut ended = false;
        let sent = sender.body(p.id, |out| {
            assert_eq!(out.id, p.id, "DATA for the file asked for");
            assert!(!ended, "nothing after the empty DATA");
            ended = out.data.is_empty();
            true
        });
        match sent {
            Ok(()) => {
                assert!(unsent.remove(&p.id), "a body for id {} sent twice or never announced", p.id);
                assert!(ended, "a body ends with an empty DATA");
            }
            Err(_) => assert!(!unsent.contains(&p.id), "an announced file {} refused", p.id),
        }
    }
});
