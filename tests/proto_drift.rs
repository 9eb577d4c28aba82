//! The wire contract cannot drift: every required row of proto/wire-fields.tsv
//! (transcribed from shared/spec/wire.md) must match the compiled descriptor
//! set, and nothing in proto/ may contradict any row.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

use std::collections::{BTreeMap, BTreeSet};

use prost::Message;
use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{DescriptorProto, FileDescriptorSet};
use zattera_agent::proto::FILE_DESCRIPTOR_SET;

#[derive(Debug, Clone, PartialEq, Eq)]
struct Row {
    kind: String,
    file: String,
    scope: String,
    name: String,
    number: String,
    ty: String,
    type_name: String,
    label: String,
    oneof: String,
    required: bool,
}

fn rows() -> Vec<Row> {
    let text = include_str!("../proto/wire-fields.tsv");
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split('\t').collect();
    assert_eq!(
        header,
        [
            "kind",
            "file",
            "scope",
            "name",
            "number",
            "type",
            "type_name",
            "label",
            "oneof",
            "required"
        ]
    );
    lines
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let c: Vec<&str> = l.split('\t').collect();
            assert_eq!(c.len(), 10, "malformed row: {l}");
            Row {
                kind: c[0].into(),
                file: c[1].into(),
                scope: c[2].into(),
                name: c[3].into(),
                number: c[4].into(),
                ty: c[5].into(),
                type_name: c[6].into(),
                label: c[7].into(),
                oneof: c[8].into(),
                required: c[9] == "yes",
            }
        })
        .collect()
}

fn type_word(t: Type) -> &'static str {
    match t {
        Type::Double => "double",
        Type::Float => "float",
        Type::Int64 => "int64",
        Type::Uint64 => "uint64",
        Type::Int32 => "int32",
        Type::Fixed64 => "fixed64",
        Type::Fixed32 => "fixed32",
        Type::Bool => "bool",
        Type::String => "string",
        Type::Group => "group",
        Type::Message => "message",
        Type::Bytes => "bytes",
        Type::Uint32 => "uint32",
        Type::Enum => "enum",
        Type::Sfixed32 => "sfixed32",
        Type::Sfixed64 => "sfixed64",
        Type::Sint32 => "sint32",
        Type::Sint64 => "sint64",
    }
}

/// Everything the compiled descriptors define, as rows of the same shape.
fn compiled() -> Vec<Row> {
    let set = FileDescriptorSet::decode(FILE_DESCRIPTOR_SET).expect("descriptor set decodes");
    let mut out = Vec::new();
    for file in &set.file {
        let fname = file.name().to_owned();
        let pkg = file.package().to_owned();
        for msg in &file.message_type {
            collect_message(&fname, &format!("{pkg}.{}", msg.name()), msg, &mut out);
        }
        for e in &file.enum_type {
            for v in &e.value {
                out.push(Row {
                    kind: "enumvalue".into(),
                    file: fname.clone(),
                    scope: format!("{pkg}.{}", e.name()),
                    name: v.name().into(),
                    number: v.number().to_string(),
                    ty: String::new(),
                    type_name: String::new(),
                    label: String::new(),
                    oneof: String::new(),
                    required: false,
                });
            }
        }
        for svc in &file.service {
            for m in &svc.method {
                let shape = |stream: bool| if stream { "stream" } else { "unary" };
                out.push(Row {
                    kind: "rpc".into(),
                    file: fname.clone(),
                    scope: format!("{pkg}.{}", svc.name()),
                    name: m.name().into(),
                    number: String::new(),
                    ty: m.input_type().trim_start_matches('.').into(),
                    type_name: m.output_type().trim_start_matches('.').into(),
                    label: format!(
                        "{}->{}",
                        shape(m.client_streaming()),
                        shape(m.server_streaming())
                    ),
                    oneof: String::new(),
                    required: false,
                });
            }
        }
    }
    out
}

fn collect_message(file: &str, scope: &str, msg: &DescriptorProto, out: &mut Vec<Row>) {
    let is_map_entry = msg
        .options
        .as_ref()
        .is_some_and(prost_types::MessageOptions::map_entry);
    if is_map_entry {
        let field = |n: i32| {
            msg.field
                .iter()
                .find(|f| f.number() == n)
                .expect("map entry field")
        };
        let (key, value) = (field(1), field(2));
        let value_type = if value.type_name().is_empty() {
            type_word(value.r#type()).to_owned()
        } else {
            value.type_name().trim_start_matches('.').to_owned()
        };
        out.push(Row {
            kind: "mapentry".into(),
            file: file.into(),
            scope: scope.into(),
            name: String::new(),
            number: String::new(),
            ty: type_word(key.r#type()).into(),
            type_name: value_type,
            label: String::new(),
            oneof: String::new(),
            required: false,
        });
        return;
    }
    for f in &msg.field {
        let oneof = f
            .oneof_index
            .and_then(|i| msg.oneof_decl.get(usize::try_from(i).ok()?))
            .map(|o| o.name().to_owned())
            .unwrap_or_default();
        out.push(Row {
            kind: "field".into(),
            file: file.into(),
            scope: scope.into(),
            name: f.name().into(),
            number: f.number().to_string(),
            ty: type_word(f.r#type()).into(),
            type_name: f.type_name().trim_start_matches('.').into(),
            label: if f.label() == Label::Repeated {
                "repeated"
            } else {
                "optional"
            }
            .into(),
            oneof,
            required: false,
        });
    }
    for nested in &msg.nested_type {
        collect_message(file, &format!("{scope}.{}", nested.name()), nested, out);
    }
}

/// What identifies a row, and what must then agree.
fn key(r: &Row) -> (String, String, String) {
    (r.kind.clone(), r.scope.clone(), r.name.clone())
}

fn shape(r: &Row) -> (String, String, String, String, String, String) {
    (
        r.file.clone(),
        r.number.clone(),
        r.ty.clone(),
        r.type_name.clone(),
        r.label.clone(),
        r.oneof.clone(),
    )
}

#[test]
fn every_required_row_is_compiled_identically() {
    let ours: BTreeMap<_, _> = compiled().into_iter().map(|r| (key(&r), r)).collect();
    let mut problems = Vec::new();
    for row in rows()
        .into_iter()
        .filter(|r| r.required && r.kind != "file")
    {
        match ours.get(&key(&row)) {
            None => problems.push(format!("missing {} {}.{}", row.kind, row.scope, row.name)),
            Some(c) if shape(c) != shape(&row) => problems.push(format!(
                "{} {}.{}: spec {:?}, proto/ {:?}",
                row.kind,
                row.scope,
                row.name,
                shape(&row),
                shape(c)
            )),
            Some(_) => {}
        }
    }
    assert!(
        problems.is_empty(),
        "wire drift:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn nothing_in_proto_contradicts_the_spec() {
    let spec = rows();
    let by_key: BTreeMap<_, _> = spec.iter().map(|r| (key(r), r)).collect();
    // A field number or enum value used by the spec under another name is a contradiction too.
    let by_number: BTreeMap<_, _> = spec
        .iter()
        .filter(|r| matches!(r.kind.as_str(), "field" | "enumvalue"))
        .map(|r| ((r.kind.clone(), r.scope.clone(), r.number.clone()), r))
        .collect();
    let mut problems = Vec::new();
    for ours in compiled() {
        if let Some(spec_row) = by_key.get(&key(&ours))
            && shape(spec_row) != shape(&ours)
        {
            problems.push(format!(
                "{} {}.{}: spec {:?}, proto/ {:?}",
                ours.kind,
                ours.scope,
                ours.name,
                shape(spec_row),
                shape(&ours)
            ));
        }
        if let Some(spec_row) =
            by_number.get(&(ours.kind.clone(), ours.scope.clone(), ours.number.clone()))
            && spec_row.name != ours.name
        {
            problems.push(format!(
                "{} {} number {}: spec calls it {}, proto/ calls it {}",
                ours.kind, ours.scope, ours.number, spec_row.name, ours.name
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "contradictions:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn the_node_facing_services_are_all_there() {
    let services: BTreeSet<String> = compiled()
        .into_iter()
        .filter(|r| r.kind == "rpc")
        .map(|r| r.scope)
        .collect();
    for s in [
        "zattera.cluster.v1.JoinService",
        "zattera.cluster.v1.AgentSyncService",
        "zattera.cluster.v1.AgentLocalService",
        "zattera.cluster.v1.RouteService",
    ] {
        assert!(services.contains(s), "{s} is not compiled");
    }
}

#[test]
fn the_transcription_covers_the_spec_tables() {
    // A truncated or emptied table would make the drift test vacuous.
    let rows = rows();
    let required = rows.iter().filter(|r| r.required).count();
    assert!(required > 400, "only {required} required rows");
    assert!(
        rows.iter()
            .any(|r| r.scope == "zattera.cluster.v1.AgentMessage" && r.name == "hello")
    );
}
