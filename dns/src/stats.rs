//! Counters of what the server was asked and how it answered, for the
//! agent's metrics: relaxed atomics, bumped once per packet, read whole at
//! scrape time. Read off the raw packets, so the request path stays free
//! of them.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::request::{Outcome, question_end};

/// Query types counted apart; the rest are `other`.
pub const QUERY_TYPES: [&str; 8] = ["A", "AAAA", "ANY", "PTR", "SRV", "TXT", "MX", "other"];
/// How queries were answered: a reply's response code, relayed upstream,
/// or dropped.
pub const ANSWERS: [&str; 7] = [
    "NOERROR",
    "NXDOMAIN",
    "SERVFAIL",
    "FORMERR",
    "other",
    "forwarded",
    "dropped",
];

#[derive(Debug, Default)]
pub struct Stats {
    queries: [AtomicU64; QUERY_TYPES.len()],
    answers: [AtomicU64; ANSWERS.len()],
}

/// A copy of the counters: `(name, count)`, every name present.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub queries: Vec<(&'static str, u64)>,
    pub answers: Vec<(&'static str, u64)>,
}

impl Stats {
    pub(crate) fn count(&self, packet: &[u8], outcome: &Outcome) {
        self.queries[query_type(packet)].fetch_add(1, Ordering::Relaxed);
        let answer = match outcome {
            Outcome::Reply(bytes) => match bytes.get(3).map(|b| b & 0x0f) {
                Some(0) => 0,
                Some(3) => 1,
                Some(2) => 2,
                Some(1) => 3,
                _ => 4,
            },
            Outcome::Forward(_) => 5,
            Outcome::Drop => 6,
        };
        self.answers[answer].fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> StatsSnapshot {
        let read = |names: &[&'static str], counts: &[AtomicU64]| {
            names
                .iter()
                .zip(counts)
                .map(|(n, c)| (*n, c.load(Ordering::Relaxed)))
                .collect()
        };
        StatsSnapshot {
            queries: read(&QUERY_TYPES, &self.queries),
            answers: read(&ANSWERS, &self.answers),
        }
    }
}

/// The index in [`QUERY_TYPES`] of the packet's question type.
fn query_type(packet: &[u8]) -> usize {
    let Some(end) = question_end(packet) else {
        return QUERY_TYPES.len() - 1;
    };
    match packet
        .get(end - 4..end - 2)
        .map(|b| u16::from_be_bytes([b[0], b[1]]))
    {
        Some(1) => 0,
        Some(28) => 1,
        Some(255) => 2,
        Some(12) => 3,
        Some(33) => 4,
        Some(16) => 5,
        Some(15) => 6,
        _ => 7,
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use hickory_proto::op::{Message, MessageType, OpCode, Query};
    use hickory_proto::rr::{Name, RecordType};

    fn query(t: RecordType) -> Vec<u8> {
        let mut m = Message::new(7, MessageType::Query, OpCode::Query);
        m.add_query(Query::query(Name::from_ascii("web.internal.").unwrap(), t));
        m.to_vec().unwrap()
    }

    #[test]
    fn counts_by_question_type_and_answer() {
        let s = Stats::default();
        let mut nx = query(RecordType::A);
        nx[3] = 0x83; // a reply header: NXDOMAIN
        s.count(&query(RecordType::A), &Outcome::Reply(nx));
        s.count(&query(RecordType::AAAA), &Outcome::Drop);
        s.count(&query(RecordType::CAA), &Outcome::Drop);
        s.count(b"junk", &Outcome::Drop);
        let got = s.snapshot();
        let of = |v: &[(&str, u64)], k: &str| v.iter().find(|(n, _)| *n == k).map(|(_, c)| *c);
        assert_eq!(of(&got.queries, "A"), Some(1));
        assert_eq!(of(&got.queries, "AAAA"), Some(1));
        assert_eq!(of(&got.queries, "other"), Some(2));
        assert_eq!(of(&got.answers, "NXDOMAIN"), Some(1));
        assert_eq!(of(&got.answers, "dropped"), Some(3));
        assert_eq!(got.queries.len(), QUERY_TYPES.len());
    }
}
