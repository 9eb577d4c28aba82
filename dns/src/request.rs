//! The request path, free of I/O: bytes in, a decision out (D-2, D-3).
//!
//! Everything a client can send reaches [`respond`] first, so this is the
//! function the fuzz target drives. It never panics on input: an unreadable
//! packet is dropped or answered FORMERR, and an encoding failure of our own
//! reply degrades to a drop (the client retries) rather than a crash.

use hickory_proto::op::{Edns, Message, MessageType, Metadata, OpCode, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{DNSClass, RData, Record, RecordType};
use tracing::debug;

pub use crate::fast::TTL;
use crate::fast::{self, CLASSIC_UDP, HEADER_LEN};
use crate::name::{InternalName, NameClass, Scope};
use crate::table::NameTable;

/// The UDP payload size we advertise and answer up to: the DNS flag day
/// value, which stays clear of IP fragmentation on any sane link.
pub const UDP_PAYLOAD: u16 = 1232;

/// How the query arrived, which decides how big an answer may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Udp,
    Tcp,
}

/// What to do with one received packet.
#[derive(Debug)]
pub enum Outcome {
    /// Send these bytes back.
    Reply(Vec<u8>),
    /// Not ours: relay the original bytes upstream (D-4). The request is
    /// kept to answer SERVFAIL if no upstream replies.
    Forward(Request),
    /// Not worth an answer (too short to carry an id, or not a query).
    Drop,
}

/// A decoded query that is being forwarded.
#[derive(Debug)]
pub struct Request {
    message: Message,
}

impl Request {
    /// SERVFAIL for this query: no upstream answered (D-4).
    pub fn servfail(&self) -> Option<Vec<u8>> {
        let mut reply = reply_to(&self.message, ResponseCode::ServFail);
        // A forwarded answer would have come from a recursive resolver.
        reply.metadata.recursion_available = true;
        reply.metadata.authoritative = false;
        encode(&reply)
    }
}

/// Decides the fate of one packet received by a listener of `scope`
/// (normalised, see [`Scope`]).
pub fn respond(packet: &[u8], scope: &Scope, table: &NameTable, transport: Transport) -> Outcome {
    // Without EDNS (the only queries the shortcut takes) UDP allows 512.
    let limit = match transport {
        Transport::Udp => CLASSIC_UDP,
        Transport::Tcp => usize::from(u16::MAX),
    };
    if let Some(answer) = fast::answer_a(packet, scope, table, limit) {
        return Outcome::Reply(answer);
    }
    respond_decoded(packet, scope, table, transport)
}

/// [`respond`] without the shortcut: every packet decoded by hickory.
pub(crate) fn respond_decoded(
    packet: &[u8],
    scope: &Scope,
    table: &NameTable,
    transport: Transport,
) -> Outcome {
    let Some(header) = packet.get(..HEADER_LEN) else {
        return Outcome::Drop;
    };
    // QR set: a response, perhaps reflected at us. Answering could loop.
    if header[2] & 0x80 != 0 {
        return Outcome::Drop;
    }
    let message = match Message::from_vec(packet) {
        Ok(m) => m,
        Err(e) => {
            debug!(error = %e, "undecodable query");
            return formerr_from_header(header);
        }
    };
    if message.metadata.op_code != OpCode::Query {
        return reply(
            &reply_to(&message, ResponseCode::NotImp),
            &message,
            transport,
        );
    }
    if message.queries.len() != 1 {
        return reply(
            &reply_to(&message, ResponseCode::FormErr),
            &message,
            transport,
        );
    }
    if message.edns.as_ref().is_some_and(|e| e.version() > 0) {
        // RFC 6891 §6.1.3: we speak EDNS version 0 only.
        return reply(
            &reply_to(&message, ResponseCode::BADVERS),
            &message,
            transport,
        );
    }
    let query = &message.queries[0];
    let name = match InternalName::from_labels(query.name().iter()) {
        NameClass::External => return Outcome::Forward(Request { message }),
        NameClass::Invalid => None,
        NameClass::Internal(name) => Some(name),
    };
    let mut answer = reply_to(&message, ResponseCode::NoError);
    match name.as_ref().and_then(|n| table.lookup(n, scope)) {
        None => answer.metadata.response_code = ResponseCode::NXDomain,
        Some(entry) => {
            let wants_a = matches!(query.query_type(), RecordType::A | RecordType::ANY)
                && matches!(query.query_class(), DNSClass::IN | DNSClass::ANY);
            if wants_a {
                // Owner name as the client wrote it (D-3), case included.
                for ip in entry.rotated() {
                    let mut record = Record::from_rdata(query.name().clone(), TTL, RData::A(A(ip)));
                    record.dns_class = DNSClass::IN;
                    answer.answers.push(record);
                }
            }
            // Any other type for a known name: NOERROR with no answer.
        }
    }
    reply(&answer, &message, transport)
}

/// The reply skeleton: same id, opcode, RD and CD, same question, AA set,
/// RA clear (D-2), and an OPT record if the query had one.
fn reply_to(request: &Message, code: ResponseCode) -> Message {
    let mut reply = Message::response(request.metadata.id, request.metadata.op_code);
    reply.metadata = Metadata::response_from_request(&request.metadata);
    reply.metadata.authoritative = true;
    reply.metadata.response_code = code;
    reply.queries.clone_from(&request.queries);
    if let Some(asked) = &request.edns {
        let mut edns = Edns::new();
        edns.set_max_payload(UDP_PAYLOAD);
        edns.set_version(0);
        // RFC 3225: echo DO, even though we sign nothing.
        edns.set_dnssec_ok(asked.flags().dnssec_ok);
        reply.edns = Some(edns);
    }
    reply
}

/// Encodes `reply`, truncating it (TC, answers dropped) when it does not fit
/// what the client can take over `transport`.
fn reply(reply: &Message, request: &Message, transport: Transport) -> Outcome {
    let limit = size_limit(request, transport);
    let Some(bytes) = encode(reply) else {
        return Outcome::Drop;
    };
    if bytes.len() <= limit {
        return Outcome::Reply(bytes);
    }
    // The client retries over TCP and gets everything there (RFC 7766).
    match encode(&reply.truncate()) {
        Some(bytes) if bytes.len() <= limit => Outcome::Reply(bytes),
        _ => Outcome::Drop,
    }
}

/// The largest answer the client takes: 512 without EDNS, its advertised
/// size (capped at ours) with EDNS, 64 KiB over TCP.
fn size_limit(request: &Message, transport: Transport) -> usize {
    match transport {
        Transport::Tcp => usize::from(u16::MAX),
        Transport::Udp => request.edns.as_ref().map_or(CLASSIC_UDP, |e| {
            usize::from(e.max_payload().min(UDP_PAYLOAD)).max(CLASSIC_UDP)
        }),
    }
}

/// FORMERR for a packet whose header is readable but whose body is not: we
/// echo the id and opcode, with no question (RFC 1035 §4.1.1).
fn formerr_from_header(header: &[u8]) -> Outcome {
    let id = u16::from_be_bytes([header[0], header[1]]);
    let op_code = OpCode::from_u8((header[2] >> 3) & 0x0f);
    let mut reply = Message::new(id, MessageType::Response, op_code);
    reply.metadata.recursion_desired = header[2] & 0x01 != 0;
    reply.metadata.response_code = ResponseCode::FormErr;
    encode(&reply).map_or(Outcome::Drop, Outcome::Reply)
}

fn encode(message: &Message) -> Option<Vec<u8>> {
    match message.to_vec() {
        Ok(bytes) => Some(bytes),
        Err(e) => {
            debug!(error = %e, "could not encode a reply");
            None
        }
    }
}

/// The byte offset just past the question section of a query with one
/// question, or `None` if the packet is too short. Used to check that an
/// upstream's answer is for the question we relayed.
pub(crate) fn question_end(packet: &[u8]) -> Option<usize> {
    let mut at = HEADER_LEN;
    loop {
        let len = usize::from(*packet.get(at)?);
        match len {
            0 => {
                at += 1;
                break;
            }
            // A compression pointer ends the name in two bytes.
            l if l & 0xc0 == 0xc0 => {
                at += 2;
                break;
            }
            l if l & 0xc0 != 0 => return None,
            l => at += 1 + l,
        }
    }
    let end = at + 4;
    (end <= packet.len()).then_some(end)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::table::RouteService;
    use hickory_proto::op::Query;
    use hickory_proto::rr::Name;
    use std::net::Ipv4Addr;
    use std::str::FromStr;

    fn table() -> NameTable {
        NameTable::from_routes(&[RouteService {
            fqdn: "db.production.shop.internal.".into(),
            project_id: "p1".into(),
            environment_id: "e1".into(),
            vip: "10.97.0.5".into(),
        }])
    }

    fn scope() -> Scope {
        Scope::new("p1", "production")
    }

    fn query(name: &str, rtype: RecordType, edns: Option<u16>) -> Vec<u8> {
        let mut m = Message::new(0x1234, MessageType::Query, OpCode::Query);
        m.metadata.recursion_desired = true;
        m.add_query(Query::query(Name::from_ascii(name).unwrap(), rtype));
        if let Some(size) = edns {
            let mut e = Edns::new();
            e.set_max_payload(size);
            m.edns = Some(e);
        }
        m.to_vec().unwrap()
    }

    fn answer(packet: &[u8]) -> Message {
        match respond(packet, &scope(), &table(), Transport::Udp) {
            Outcome::Reply(bytes) => Message::from_vec(&bytes).unwrap(),
            other => panic!("expected a reply, got {other:?}"),
        }
    }

    #[test]
    fn known_name_gets_one_authoritative_a_record_with_ttl_5() {
        let m = answer(&query("DB.internal.", RecordType::A, None));
        assert_eq!(m.metadata.id, 0x1234);
        assert_eq!(m.metadata.response_code, ResponseCode::NoError);
        assert!(m.metadata.authoritative);
        assert!(!m.metadata.recursion_available);
        assert!(m.metadata.recursion_desired);
        assert_eq!(m.answers.len(), 1);
        assert_eq!(m.answers[0].ttl, TTL);
        assert_eq!(m.answers[0].name.to_string(), "DB.internal.");
        assert_eq!(m.answers[0].data, RData::A(A(Ipv4Addr::new(10, 97, 0, 5))));
        assert!(m.edns.is_none());
    }

    #[test]
    fn other_types_are_nodata_and_unknown_names_nxdomain() {
        let m = answer(&query(
            "db.production.shop.internal.",
            RecordType::AAAA,
            None,
        ));
        assert_eq!(m.metadata.response_code, ResponseCode::NoError);
        assert!(m.answers.is_empty());
        let m = answer(&query("nope.internal.", RecordType::A, None));
        assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);
        assert!(m.authorities.is_empty());
        let m = answer(&query("db.staging.shop.internal.", RecordType::A, None));
        assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);
        let m = answer(&query("internal.", RecordType::A, None));
        assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);
    }

    #[test]
    fn edns_is_answered_with_our_payload_and_badvers_for_v1() {
        let m = answer(&query("db.internal.", RecordType::A, Some(4096)));
        let edns = m.edns.unwrap();
        assert_eq!(edns.max_payload(), UDP_PAYLOAD);
        assert_eq!(edns.version(), 0);
        let mut q = Message::from_vec(&query("db.internal.", RecordType::A, Some(4096))).unwrap();
        q.edns.as_mut().unwrap().set_version(1);
        let m = answer(&q.to_vec().unwrap());
        // BADVERS shares code 16 with BADSIG; hickory decodes it as the latter.
        assert_eq!(u16::from(m.metadata.response_code), 16);
        assert!(m.edns.is_some());
    }

    #[test]
    fn external_names_are_forwarded_and_servfail_keeps_the_id() {
        let packet = query("example.test.", RecordType::A, None);
        let Outcome::Forward(req) = respond(&packet, &scope(), &table(), Transport::Udp) else {
            panic!("expected forward");
        };
        let m = Message::from_vec(&req.servfail().unwrap()).unwrap();
        assert_eq!(m.metadata.id, 0x1234);
        assert_eq!(m.metadata.response_code, ResponseCode::ServFail);
        assert_eq!(m.queries.len(), 1);
    }

    #[test]
    fn big_answers_are_truncated_over_udp_only() {
        let instances: Vec<_> = (0..60u8)
            .map(|i| crate::table::LocalInstance {
                project_id: "p1".into(),
                project_name: "shop".into(),
                environment: "production".into(),
                app: "web".into(),
                ip: Ipv4Addr::new(10, 201, 0, i),
            })
            .collect();
        let t = NameTable::from_instances(&instances);
        let packet = query("web.internal.", RecordType::A, None);
        let Outcome::Reply(udp) = respond(&packet, &scope(), &t, Transport::Udp) else {
            panic!()
        };
        let m = Message::from_vec(&udp).unwrap();
        assert!(udp.len() <= 512);
        assert!(m.metadata.truncation);
        assert!(m.answers.is_empty());
        let Outcome::Reply(tcp) = respond(&packet, &scope(), &t, Transport::Tcp) else {
            panic!()
        };
        let m = Message::from_vec(&tcp).unwrap();
        assert!(!m.metadata.truncation);
        assert_eq!(m.answers.len(), 60);
        // With EDNS the client's larger buffer is honoured up to ours.
        let packet = query("web.internal.", RecordType::A, Some(4096));
        let Outcome::Reply(udp) = respond(&packet, &scope(), &t, Transport::Udp) else {
            panic!()
        };
        assert!(udp.len() > 512 && udp.len() <= usize::from(UDP_PAYLOAD));
        assert_eq!(Message::from_vec(&udp).unwrap().answers.len(), 60);
    }

    #[test]
    fn garbage_is_dropped_or_formerr() {
        assert!(matches!(
            respond(b"short", &scope(), &table(), Transport::Udp),
            Outcome::Drop
        ));
        // A response (QR set) is never answered.
        let mut packet = query("db.internal.", RecordType::A, None);
        packet[2] |= 0x80;
        assert!(matches!(
            respond(&packet, &scope(), &table(), Transport::Udp),
            Outcome::Drop
        ));
        // A header claiming a question that is not there: FORMERR.
        let packet = [0xab, 0xcd, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0, 7, b'x'];
        let m = answer(&packet);
        assert_eq!(m.metadata.id, 0xabcd);
        assert_eq!(m.metadata.response_code, ResponseCode::FormErr);
        // Two questions: FORMERR.
        let mut m2 = Message::from_vec(&query("db.internal.", RecordType::A, None)).unwrap();
        m2.add_query(Query::query(
            Name::from_str("x.internal.").unwrap(),
            RecordType::A,
        ));
        let m = answer(&m2.to_vec().unwrap());
        assert_eq!(m.metadata.response_code, ResponseCode::FormErr);
        // Not a query opcode: NOTIMP.
        let mut m3 = Message::from_vec(&query("db.internal.", RecordType::A, None)).unwrap();
        m3.metadata.op_code = OpCode::Status;
        let m = answer(&m3.to_vec().unwrap());
        assert_eq!(m.metadata.response_code, ResponseCode::NotImp);
    }

    #[test]
    fn every_prefix_and_bit_flip_of_a_query_is_survived() {
        let packet = query("db.production.shop.internal.", RecordType::A, Some(1232));
        for len in 0..packet.len() {
            let _ = respond(&packet[..len], &scope(), &table(), Transport::Udp);
        }
        for byte in 0..packet.len() {
            for bit in 0..8 {
                let mut p = packet.clone();
                p[byte] ^= 1 << bit;
                let _ = respond(&p, &scope(), &table(), Transport::Udp);
            }
        }
    }

    #[test]
    fn question_end_finds_the_end_of_the_question() {
        let packet = query("example.test.", RecordType::A, Some(1232));
        // 12 header + 14 name ("\x07example\x04test\x00") + 4.
        assert_eq!(question_end(&packet), Some(30));
        assert_eq!(question_end(&packet[..20]), None);
    }
}
