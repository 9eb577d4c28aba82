//! Keeping secrets out of logs and error texts: presigned URLs carry their
//! signature in the query, and URLs may carry credentials before the host.

/// `url` without its user info and query (`https://h/p?X-Amz-Signature=…`
/// → `https://h/p?…`), for logs and messages.
pub fn url(url: &str) -> String {
    let (base, had_query) = match url.split_once(['?', '#']) {
        Some((b, _)) => (b, true),
        None => (url, false),
    };
    let base = match base.split_once("://") {
        Some((scheme, rest)) => {
            let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
            let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
            format!("{scheme}://{host}{path}")
        }
        None => base.to_owned(),
    };
    if had_query {
        format!("{base}?…")
    } else {
        base
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn signatures_and_credentials_are_dropped() {
        assert_eq!(
            url("https://s3.example/b/k?X-Amz-Signature=abc&X-Amz-Credential=x"),
            "https://s3.example/b/k?…"
        );
        assert_eq!(
            url("https://user:pw@r.example/v2/x"),
            "https://r.example/v2/x"
        );
        assert_eq!(url("http://h:8080/a/b"), "http://h:8080/a/b");
        assert_eq!(url("not a url"), "not a url");
        assert!(!url("https://t@h/p?token=s3cret").contains("s3cret"));
    }
}
