//! The shortcut for the query that is nearly all internal traffic: one A
//! question (class IN) for a known internal name, no EDNS, nothing else in
//! the packet. It is answered straight from the wire bytes, without
//! decoding into hickory's `Message` and encoding one back, which was most
//! of the resolver's own CPU per query (the rest is the kernel's).
//!
//! Anything else, or anything odd about it, returns `None` and takes the
//! full path ([`crate::request::respond`]); the answer here is the same,
//! byte for byte, as that path's (tested below), so the shortcut changes
//! speed only.

use crate::name::{InternalName, NameClass, Scope};
use crate::table::NameTable;

/// TTL of every internal answer (D-3).
pub const TTL: u32 = 5;

/// Plain DNS over UDP without EDNS (RFC 1035).
pub(crate) const CLASSIC_UDP: usize = 512;

/// A DNS header is 12 bytes; anything shorter has no id to answer to.
pub(crate) const HEADER_LEN: usize = 12;

/// A name of at most 255 bytes has at most 127 labels; ours have 2 or 4.
const MAX_LABELS: usize = 4;
/// Name pointer to offset 12 (the question's name), type A, class IN, the
/// TTL, then 4 bytes of address.
const RECORD_LEN: usize = 16;
const TYPE_A: [u8; 2] = [0, 1];
const CLASS_IN: [u8; 2] = [0, 1];

/// The answer to `packet` if it is the common internal A query of a name
/// `table` has for `scope` (normalised), else `None`. `limit` is the
/// largest answer the transport allows.
pub(crate) fn answer_a(
    packet: &[u8],
    scope: &Scope,
    table: &NameTable,
    limit: usize,
) -> Option<Vec<u8>> {
    let header = packet.get(..HEADER_LEN)?;
    // A query (QR clear), opcode QUERY, not truncated; Z clear.
    if header[2] & 0xfa != 0 || header[3] & 0x40 != 0 {
        return None;
    }
    // One question, nothing else (an OPT record means EDNS: full path).
    if header[4..12] != [0, 1, 0, 0, 0, 0, 0, 0] {
        return None;
    }
    let (labels, name_end) = labels(packet)?;
    let question_end = name_end + 4;
    if packet.len() != question_end
        || packet[name_end..name_end + 2] != TYPE_A
        || packet[name_end + 2..question_end] != CLASS_IN
    {
        return None;
    }
    let NameClass::Internal(name) = InternalName::from_labels(labels.iter().flatten().copied())
    else {
        return None;
    };
    let entry = table.lookup(&name, scope)?;
    let len = question_end + RECORD_LEN * entry.len();
    let count = u16::try_from(entry.len()).ok()?;
    if len > limit {
        return None;
    }
    let mut answer = Vec::with_capacity(len);
    answer.extend_from_slice(&header[..2]);
    // QR, AA and the query's RD; then the query's CD, RA and AD clear.
    answer.push(0x84 | (header[2] & 0x01));
    answer.push(header[3] & 0x10);
    answer.extend_from_slice(&[0, 1]);
    answer.extend_from_slice(&count.to_be_bytes());
    answer.extend_from_slice(&[0, 0, 0, 0]);
    answer.extend_from_slice(&packet[HEADER_LEN..question_end]);
    for ip in entry.rotated() {
        answer.extend_from_slice(&[0xc0, 0x0c]);
        answer.extend_from_slice(&TYPE_A);
        answer.extend_from_slice(&CLASS_IN);
        answer.extend_from_slice(&TTL.to_be_bytes());
        answer.extend_from_slice(&[0, 4]);
        answer.extend_from_slice(&ip.octets());
    }
    Some(answer)
}

/// The labels of the question's name (uncompressed, at most
/// [`MAX_LABELS`]) and the offset just past its root label.
fn labels(packet: &[u8]) -> Option<([Option<&[u8]>; MAX_LABELS], usize)> {
    let mut labels = [None; MAX_LABELS];
    let mut at = HEADER_LEN;
    for slot in 0..=MAX_LABELS {
        let len = usize::from(*packet.get(at)?);
        if len == 0 {
            return Some((labels, at + 1));
        }
        // A pointer or an extended label type (top bits set), or too many
        // labels: not ours to take apart here.
        if len > 63 || slot == MAX_LABELS {
            return None;
        }
        labels[slot] = Some(packet.get(at + 1..at + 1 + len)?);
        at += 1 + len;
    }
    None
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::request::{Outcome, Transport, respond_decoded};
    use crate::table::RouteService;
    use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query};
    use hickory_proto::rr::{Name, RecordType};

    fn table() -> NameTable {
        let mut services = vec![RouteService {
            fqdn: "db.production.shop.internal.".into(),
            project_id: "p1".into(),
            environment_id: "e1".into(),
            vip: "10.97.0.5".into(),
        }];
        // Many addresses: rotation, and an answer past 512 bytes.
        for i in 0..40 {
            services.push(RouteService {
                fqdn: "many.production.shop.internal.".into(),
                project_id: "p1".into(),
                environment_id: "e1".into(),
                vip: format!("10.97.1.{i}"),
            });
        }
        NameTable::from_routes(&services)
    }

    fn scope() -> Scope {
        Scope::new("p1", "production")
    }

    fn query(name: &str, rtype: RecordType, rd: bool, cd: bool) -> Vec<u8> {
        let mut m = Message::new(0xbeef, MessageType::Query, OpCode::Query);
        m.metadata.recursion_desired = rd;
        m.metadata.checking_disabled = cd;
        m.add_query(Query::query(Name::from_ascii(name).unwrap(), rtype));
        m.to_vec().unwrap()
    }

    /// The full path's answer, with a table of its own, so both paths see
    /// the same rotation turn.
    fn full_path(packet: &[u8]) -> Option<Vec<u8>> {
        match respond_decoded(packet, &scope(), &table(), Transport::Udp) {
            Outcome::Reply(bytes) => Some(bytes),
            _ => None,
        }
    }

    #[test]
    fn answers_are_the_full_paths_byte_for_byte() {
        for name in [
            "db.internal.",
            "DB.Internal.",
            "db.production.shop.internal.",
            "Db.PRODUCTION.Shop.internal.",
        ] {
            for (rd, cd) in [(false, false), (true, false), (true, true), (false, true)] {
                let packet = query(name, RecordType::A, rd, cd);
                let fast = answer_a(&packet, &scope(), &table(), CLASSIC_UDP);
                assert!(fast.is_some(), "{name} rd={rd} cd={cd} not taken");
                assert_eq!(fast, full_path(&packet), "{name} rd={rd} cd={cd}");
            }
        }
    }

    #[test]
    fn rotation_matches_the_full_path_answer_for_answer() {
        let packet = query("many.internal.", RecordType::A, true, false);
        let (fast_table, full_table) = (table(), table());
        for _ in 0..3 {
            let fast = answer_a(&packet, &scope(), &fast_table, usize::from(u16::MAX));
            let full = match respond_decoded(&packet, &scope(), &full_table, Transport::Tcp) {
                Outcome::Reply(bytes) => bytes,
                other => panic!("{other:?}"),
            };
            assert_eq!(fast, Some(full));
        }
    }

    #[test]
    fn everything_else_is_left_to_the_full_path() {
        let s = scope();
        let t = table();
        let take = |p: &[u8]| answer_a(p, &s, &t, CLASSIC_UDP);
        // Unknown, other scope, external, invalid, other types.
        assert!(take(&query("nope.internal.", RecordType::A, true, false)).is_none());
        assert!(
            take(&query(
                "db.staging.shop.internal.",
                RecordType::A,
                true,
                false
            ))
            .is_none()
        );
        assert!(take(&query("example.com.", RecordType::A, true, false)).is_none());
        assert!(take(&query("a.b.internal.", RecordType::A, true, false)).is_none());
        assert!(take(&query("a.b.c.d.e.internal.", RecordType::A, true, false)).is_none());
        assert!(take(&query("db.internal.", RecordType::AAAA, true, false)).is_none());
        assert!(take(&query("db.internal.", RecordType::ANY, true, false)).is_none());
        // Too big for 512 bytes: the full path truncates.
        assert!(take(&query("many.internal.", RecordType::A, true, false)).is_none());
        // EDNS.
        let mut m = Message::from_vec(&query("db.internal.", RecordType::A, true, false)).unwrap();
        m.edns = Some(Edns::new());
        assert!(take(&m.to_vec().unwrap()).is_none());
        // A response, another opcode, TC or Z set, trailing bytes, cut short.
        let good = query("db.internal.", RecordType::A, true, false);
        assert!(take(&good).is_some());
        for (byte, bit) in [(2, 0x80), (2, 0x10), (2, 0x02), (3, 0x40)] {
            let mut p = good.clone();
            p[byte] |= bit;
            assert!(take(&p).is_none(), "byte {byte} bit {bit:#x}");
        }
        let mut p = good.clone();
        p.push(0);
        assert!(take(&p).is_none());
        for cut in 0..good.len() {
            assert!(take(&good[..cut]).is_none(), "cut at {cut}");
        }
        // A compressed question name.
        let mut p = good[..12].to_vec();
        p.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1]);
        assert!(take(&p).is_none());
    }
}
