//! Turning a byte span from a `toml` error into the dotted key path a user
//! recognises (`env.production.ports[0].container_port`).
//!
//! serde errors from `toml` carry only a span into the document. We re-read
//! the document as a spanned tree and pick the innermost key or value whose
//! span contains the error's span; that names the key without any bespoke
//! deserializer.

use std::ops::Range;

use toml::Spanned;
use toml::de::{DeTable, DeValue};

/// The dotted path of the innermost key or value containing `span`, or
/// `None` when the document does not parse or the span lies at the top level.
/// An empty span means the document itself (toml reports a missing
/// top-level key at `0..0`).
pub fn key_path_at(text: &str, span: &Range<usize>) -> Option<String> {
    if span.is_empty() {
        return None;
    }
    let table = DeTable::parse(text).ok()?;
    let mut best: Option<(usize, usize, String)> = None;
    let mut consider = |path: &str, depth: usize, s: Range<usize>| {
        if path.is_empty() || s.start > span.start || span.end > s.end {
            return;
        }
        let len = s.end - s.start;
        let better = match &best {
            None => true,
            Some((best_len, best_depth, _)) => {
                len < *best_len || (len == *best_len && depth > *best_depth)
            }
        };
        if better {
            best = Some((len, depth, path.to_owned()));
        }
    };
    walk_table(table.get_ref(), "", 0, &mut consider);
    best.map(|(_, _, path)| path)
}

fn walk_table(
    table: &DeTable<'_>,
    prefix: &str,
    depth: usize,
    consider: &mut impl FnMut(&str, usize, Range<usize>),
) {
    for (key, value) in table {
        let path = if prefix.is_empty() {
            render_key(key.get_ref())
        } else {
            format!("{prefix}.{}", render_key(key.get_ref()))
        };
        consider(&path, depth + 1, key.span());
        walk_value(value, &path, depth + 1, consider);
    }
}

fn walk_value(
    value: &Spanned<DeValue<'_>>,
    path: &str,
    depth: usize,
    consider: &mut impl FnMut(&str, usize, Range<usize>),
) {
    consider(path, depth, value.span());
    match value.get_ref() {
        DeValue::Table(t) => walk_table(t, path, depth, consider),
        DeValue::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                walk_value(item, &format!("{path}[{i}]"), depth + 1, consider);
            }
        }
        _ => {}
    }
}

/// A key as TOML would accept it: bare when it can be, quoted otherwise.
pub fn render_key(key: &str) -> String {
    let bare = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if bare {
        key.to_owned()
    } else {
        format!("{key:?}")
    }
}

/// 1-based line and column (in characters) of byte offset `at`.
pub fn line_column(text: &str, at: usize) -> (usize, usize) {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    let before = &text[..at];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn path_of(text: &str, needle: &str) -> Option<String> {
        let start = text.find(needle).unwrap();
        key_path_at(text, &(start..start + needle.len()))
    }

    #[test]
    fn names_keys_values_and_array_elements() {
        let text = "[app]\nname = 'x'\n[env.production]\nreplicas = 2\n\
                    [[env.production.ports]]\nname = 'a'\n\
                    [[env.production.ports]]\nname = 'b'\ncontainer_port = 1\n\
                    [env.production.variables]\n\"my.var\" = 'v'\n";
        assert_eq!(path_of(text, "name").as_deref(), Some("app.name"));
        assert_eq!(
            path_of(text, "2").as_deref(),
            Some("env.production.replicas")
        );
        assert_eq!(
            path_of(text, "'b'").as_deref(),
            Some("env.production.ports[1].name")
        );
        // A table-level error (missing key) points at the element's header.
        let first = text.find("[[env").unwrap();
        assert_eq!(
            key_path_at(text, &(first..first + "[[env.production.ports]]".len())).as_deref(),
            Some("env.production.ports[0]")
        );
        assert_eq!(
            path_of(text, "'v'").as_deref(),
            Some("env.production.variables.\"my.var\"")
        );
        // The whole document is not a key.
        assert_eq!(key_path_at(text, &(0..0)), None);
        assert_eq!(key_path_at("[app", &(0..1)), None);
    }

    #[test]
    fn line_and_column_are_one_based() {
        let text = "a = 1\nbé = 2\n";
        assert_eq!(line_column(text, 0), (1, 1));
        assert_eq!(line_column(text, text.find('2').unwrap()), (2, 6));
        assert_eq!(line_column(text, 10_000), (3, 1));
    }
}
