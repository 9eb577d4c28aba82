//! The request path with arbitrary bytes: it must never panic, every reply
//! it makes must decode, fit the transport, and answer the id it was asked.
#![no_main]

use std::net::Ipv4Addr;
use std::sync::LazyLock;

use hickory_proto::op::{Message, MessageType};
use libfuzzer_sys::fuzz_target;
use zattera_dns::request::{Outcome, Transport, respond};
use zattera_dns::{LocalInstance, NameTable, Scope};

static TABLE: LazyLock<NameTable> = LazyLock::new(|| {
    let inst = |env: &str, app: &str, ip: Ipv4Addr| LocalInstance {
        project_id: "p1".into(),
        project_name: "shop".into(),
        environment: env.into(),
        app: app.into(),
        ip,
    };
    let mut all = vec![
        inst("production", "db", Ipv4Addr::new(10, 97, 0, 5)),
        inst("staging", "db", Ipv4Addr::new(10, 97, 0, 6)),
    ];
    // A name with many addresses, to reach truncation.
    all.extend((0..120u8).map(|i| inst("production", "w", Ipv4Addr::new(10, 201, 0, i))));
    NameTable::from_instances(&all)
});

fuzz_target!(|data: &[u8]| {
    let scope = Scope::new("p1", "production");
    for transport in [Transport::Udp, Transport::Tcp] {
        match respond(data, &scope, &TABLE, transport) {
            Outcome::Reply(bytes) => {
                let m = Message::from_vec(&bytes).expect("our reply decodes");
                assert_eq!(m.metadata.message_type, MessageType::Response);
                assert_eq!(bytes[..2], data[..2], "reply keeps the query id");
                if transport == Transport::Udp {
                    assert!(bytes.len() <= 1232, "udp reply of {} bytes", bytes.len());
                }
            }
            Outcome::Forward(request) => {
                let servfail = request.servfail().expect("servfail encodes");
                Message::from_vec(&servfail).expect("servfail decodes");
            }
            Outcome::Drop => {}
        }
    }
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = zattera_dns::InternalName::parse(text);
    }
});
