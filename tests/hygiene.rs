//! Tests that can fail (issue 60): every test of the workspace, in `tests/`
//! and in the unit-test modules of every crate, read as Rust (`syn`):
//!
//! - it asserts, in its own body: an `assert*!`, `panic!` or
//!   `unreachable!`, an `unwrap_err`/`expect_err`, or a call of a helper
//!   named for its check (`assert_*`, `wait_*`: a wait fails on timeout);
//! - it never discards what it does with `let _ =` or a statement ending in
//!   `.ok();` (clean-up is spelled out, or allowed below with the reason);
//! - it never returns early without saying why: a `return` must follow a
//!   call of something that records a skip (`zattera_testkit`, or a helper
//!   that calls it, such as the rig's `rig()`).
//!
//! An exception is allowed only in [`ALLOWED`], with its reason.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use syn::spanned::Spanned;
use syn::visit::Visit;

/// (file, test, rule, why): the exceptions, each with its reason.
const ALLOWED: &[(&str, &str, &str, &str)] = &[
    (
        "dns/src/request.rs",
        "every_prefix_and_bit_flip_of_a_query_is_survived",
        "no let _ =",
        "the property is that no input panics: every answer is fine",
    ),
    (
        "dns/src/request.rs",
        "every_prefix_and_bit_flip_of_a_query_is_survived",
        "an assertion",
        "the property is that no input panics, which the run itself checks",
    ),
    (
        "tests/cluster.rs",
        "run_after_join_syncs_with_the_address_the_join_returned",
        "no let _ =",
        "awaits the forwarder it just aborted: its JoinError is the expected outcome",
    ),
    (
        "tests/vip.rs",
        "vip_connections_reach_healthy_endpoints_only",
        "no let _ =",
        "a reply is read until the server closes; an error is no reply, which the \
         comparison with the echo that follows counts",
    ),
];

/// The directories whose Rust files are read.
const ROOTS: &[&str] = &[
    "src",
    "tests",
    "dns/src",
    "dns/tests",
    "netns/src",
    "netns/tests",
    "netns-cli/src",
    "netns-cli/tests",
    "mesh/src",
    "testkit/src",
    "benches",
];

/// What the testkit's skipping functions are called: a call of one of
/// these, or of a helper that calls one, announces a skip.
const SKIPPERS: &[&str] = &["require", "require_root", "missing", "skip"];

/// Clean-up whose failure changes nothing a test checks: a `let _ =` of a
/// call of one of these is fine (a process already gone, a file already
/// removed, a mount already undone).
const CLEANUP: &[&str] = &[
    "kill",
    "wait",
    "remove_file",
    "remove_dir",
    "remove_dir_all",
    "remove_rules",
    "shutdown",
];

/// Commands a test runs only to clean up after itself.
const CLEANUP_COMMANDS: &[&str] = &["umount", "ip", "nft"];

/// Helpers whose name says they check: a call of one is an assertion.
fn is_check(name: &str) -> bool {
    name.starts_with("assert_") || name.starts_with("wait_")
}

fn rust_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    let mut dirs: Vec<PathBuf> = ROOTS.iter().map(|r| root.join(r)).collect();
    while let Some(d) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

fn last_segment(path: &syn::Path) -> String {
    path.segments
        .last()
        .map(|s| s.ident.to_string())
        .unwrap_or_default()
}

fn is_test_attr(attr: &syn::Attribute) -> bool {
    let p = attr.path();
    p.segments.last().is_some_and(|s| s.ident == "test") && !p.is_ident("cfg")
}

/// What one function body does, as far as these rules care.
#[derive(Default)]
struct Body {
    asserts: bool,
    testkit_skip: bool,
    calls: BTreeSet<String>,
}

impl<'ast> Visit<'ast> for Body {
    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        let name = last_segment(&m.path);
        if name.starts_with("assert") || name == "panic" || name == "unreachable" {
            self.asserts = true;
        }
        // Calls inside other macros (`format!`, `vec!`, `select!`): read
        // as expressions where they parse.
        if let Ok(exprs) = m.parse_body_with(
            syn::punctuated::Punctuated::<syn::Expr, syn::Token![,]>::parse_terminated,
        ) {
            for e in &exprs {
                self.visit_expr(e);
            }
        }
    }
    fn visit_expr_call(&mut self, c: &'ast syn::ExprCall) {
        if let syn::Expr::Path(p) = &*c.func {
            let name = last_segment(&p.path);
            let in_testkit = p.path.segments.iter().any(|s| s.ident == "zattera_testkit");
            if in_testkit && SKIPPERS.contains(&name.as_str()) {
                self.testkit_skip = true;
            }
            self.calls.insert(name);
        }
        syn::visit::visit_expr_call(self, c);
    }
    fn visit_expr_method_call(&mut self, c: &'ast syn::ExprMethodCall) {
        let name = c.method.to_string();
        if name == "unwrap_err" || name == "expect_err" {
            self.asserts = true;
        }
        self.calls.insert(name);
        syn::visit::visit_expr_method_call(self, c);
    }
}

/// Every function of the test code (files under a `tests/` directory and
/// `#[cfg(test)]` modules) by name: whether it records a skip, directly or
/// through what it calls.
#[derive(Default)]
struct Helpers {
    bodies: BTreeMap<String, Vec<Body>>,
    /// Whether the code being read is test code.
    in_tests: bool,
}

impl Helpers {
    fn add(&mut self, name: String, block: &syn::Block) {
        let mut b = Body::default();
        b.visit_block(block);
        self.bodies.entry(name).or_default().push(b);
    }

    /// The names for which `direct` holds, closed over calls.
    fn closure(&self, direct: impl Fn(&Body) -> bool) -> BTreeSet<String> {
        let mut yes: BTreeSet<String> = self
            .bodies
            .iter()
            .filter(|(_, bs)| bs.iter().any(&direct))
            .map(|(n, _)| n.clone())
            .collect();
        loop {
            let more: Vec<String> = self
                .bodies
                .iter()
                .filter(|(n, _)| !yes.contains(*n))
                .filter(|(_, bs)| bs.iter().any(|b| b.calls.iter().any(|c| yes.contains(c))))
                .map(|(n, _)| n.clone())
                .collect();
            if more.is_empty() {
                return yes;
            }
            yes.extend(more);
        }
    }
}

impl<'ast> Visit<'ast> for Helpers {
    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        let outer = self.in_tests;
        self.in_tests |= m.attrs.iter().any(|a| {
            a.path().is_ident("cfg")
                && a.parse_args::<syn::Meta>()
                    .is_ok_and(|m| m.path().is_ident("test"))
        });
        syn::visit::visit_item_mod(self, m);
        self.in_tests = outer;
    }
    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        if self.in_tests {
            self.add(f.sig.ident.to_string(), &f.block);
        }
        syn::visit::visit_item_fn(self, f);
    }
    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if self.in_tests {
            self.add(f.sig.ident.to_string(), &f.block);
        }
        syn::visit::visit_impl_item_fn(self, f);
    }
}

/// Whether a discarded expression is clean-up (see [`CLEANUP`]).
fn is_cleanup(expr: &syn::Expr) -> bool {
    match expr {
        syn::Expr::Await(a) => is_cleanup(&a.base),
        syn::Expr::Try(t) => is_cleanup(&t.expr),
        syn::Expr::MethodCall(m) => {
            let name = m.method.to_string();
            CLEANUP.contains(&name.as_str())
                || ((name == "status" || name == "output") && runs_cleanup_command(&m.receiver))
        }
        syn::Expr::Call(c) => {
            matches!(&*c.func, syn::Expr::Path(p) if CLEANUP.contains(&last_segment(&p.path).as_str()))
        }
        _ => false,
    }
}

/// `Command::new("umount")...`: the receiver chain starts with a clean-up command.
fn runs_cleanup_command(expr: &syn::Expr) -> bool {
    match expr {
        syn::Expr::MethodCall(m) => runs_cleanup_command(&m.receiver),
        syn::Expr::Call(c) => c.args.first().is_some_and(|a| {
            matches!(a, syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Str(s), .. })
                if CLEANUP_COMMANDS.contains(&s.value().as_str()))
        }),
        _ => false,
    }
}

/// A finding: (file, test, rule, line, detail).
type Finding = (String, String, &'static str, usize, String);

/// The rules, over one test's body.
struct Rules<'a> {
    file: String,
    test: String,
    skippers: &'a BTreeSet<String>,
    /// Whether a skip was announced in the enclosing statements so far.
    announced: Vec<bool>,
    /// Depth of closures that are not `async` (their returns are theirs).
    in_sync_closure: usize,
    /// Depth of spawned code (a peer the test runs, not the code it tests).
    in_spawn: usize,
    /// Depth of `async` blocks that are values of their own (an argument
    /// of `timeout`): their returns are theirs. An `async` block that is a
    /// closure's body (`on_rig(.., |ctd, rig| async move {..})`) is the test.
    in_async_value: usize,
    found: Vec<Finding>,
}

impl Rules<'_> {
    fn calls_skipper(&self, visit: impl FnOnce(&mut Body)) -> bool {
        let mut b = Body::default();
        visit(&mut b);
        b.testkit_skip || b.calls.iter().any(|c| self.skippers.contains(c))
    }

    fn flag(&mut self, rule: &'static str, at: proc_macro2::Span, detail: String) {
        self.found.push((
            self.file.clone(),
            self.test.clone(),
            rule,
            at.start().line,
            detail,
        ));
    }
}

impl<'ast> Visit<'ast> for Rules<'_> {
    fn visit_block(&mut self, block: &'ast syn::Block) {
        let outer = self.announced.last().copied().unwrap_or(false);
        self.announced.push(outer);
        for stmt in &block.stmts {
            self.visit_stmt(stmt);
            if self.calls_skipper(|b| b.visit_stmt(stmt)) {
                *self.announced.last_mut().unwrap() = true;
            }
        }
        self.announced.pop();
    }
    fn visit_stmt(&mut self, stmt: &'ast syn::Stmt) {
        if let syn::Stmt::Expr(syn::Expr::MethodCall(m), Some(_)) = stmt
            && m.method == "ok"
            && self.in_spawn == 0
            && !is_cleanup(&m.receiver)
        {
            self.flag(
                "no .ok();",
                m.span(),
                "a result discarded with .ok()".into(),
            );
        }
        syn::visit::visit_stmt(self, stmt);
    }
    fn visit_local(&mut self, local: &'ast syn::Local) {
        if matches!(local.pat, syn::Pat::Wild(_))
            && self.in_spawn == 0
            && !local.init.as_ref().is_some_and(|i| is_cleanup(&i.expr))
        {
            self.flag(
                "no let _ =",
                local.span(),
                "a result discarded with let _ =".into(),
            );
        }
        if let (Some(init), Some((_, diverge))) = (
            &local.init,
            local.init.as_ref().and_then(|i| i.diverge.as_ref()),
        ) {
            self.visit_expr(&init.expr);
            let announced = self.calls_skipper(|b| b.visit_expr(&init.expr));
            self.announced
                .push(announced || *self.announced.last().unwrap_or(&false));
            self.visit_expr(diverge);
            self.announced.pop();
            return;
        }
        syn::visit::visit_local(self, local);
    }
    fn visit_expr_if(&mut self, e: &'ast syn::ExprIf) {
        self.visit_expr(&e.cond);
        let announced = self.calls_skipper(|b| b.visit_expr(&e.cond));
        self.announced
            .push(announced || *self.announced.last().unwrap_or(&false));
        self.visit_block(&e.then_branch);
        self.announced.pop();
        if let Some((_, other)) = &e.else_branch {
            self.visit_expr(other);
        }
    }
    fn visit_expr_call(&mut self, c: &'ast syn::ExprCall) {
        let spawn =
            matches!(&*c.func, syn::Expr::Path(p) if last_segment(&p.path).starts_with("spawn"));
        self.in_spawn += usize::from(spawn);
        syn::visit::visit_expr_call(self, c);
        self.in_spawn -= usize::from(spawn);
    }
    fn visit_expr_closure(&mut self, c: &'ast syn::ExprClosure) {
        if let syn::Expr::Async(body) = &*c.body {
            self.visit_block(&body.block);
            return;
        }
        let sync = c.asyncness.is_none();
        self.in_sync_closure += usize::from(sync);
        syn::visit::visit_expr_closure(self, c);
        self.in_sync_closure -= usize::from(sync);
    }
    fn visit_expr_async(&mut self, a: &'ast syn::ExprAsync) {
        self.in_async_value += 1;
        syn::visit::visit_expr_async(self, a);
        self.in_async_value -= 1;
    }
    fn visit_expr_return(&mut self, r: &'ast syn::ExprReturn) {
        if self.in_sync_closure == 0
            && self.in_async_value == 0
            && !self.announced.last().copied().unwrap_or(false)
        {
            self.flag(
                "no silent return",
                r.span(),
                "returns before its checks, saying nothing".into(),
            );
        }
        syn::visit::visit_expr_return(self, r);
    }
    fn visit_item_fn(&mut self, _: &'ast syn::ItemFn) {
        // A function declared inside a test is a helper, not the test.
    }
}

/// Every test function of the workspace: (file, name, body).
fn tests_in(file: &str, ast: &syn::File) -> Vec<(String, String, syn::ItemFn)> {
    struct Finder<'f> {
        file: &'f str,
        out: Vec<(String, String, syn::ItemFn)>,
    }
    impl<'ast> Visit<'ast> for Finder<'_> {
        fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
            if f.attrs.iter().any(is_test_attr) {
                self.out
                    .push((self.file.to_owned(), f.sig.ident.to_string(), f.clone()));
            }
            syn::visit::visit_item_fn(self, f);
        }
    }
    let mut finder = Finder {
        file,
        out: Vec::new(),
    };
    finder.visit_file(ast);
    finder.out
}

fn findings() -> (Vec<Finding>, usize) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut helpers = Helpers::default();
    let mut parsed = Vec::new();
    for path in rust_files() {
        let text = std::fs::read_to_string(&path).unwrap();
        let ast = syn::parse_file(&text)
            .unwrap_or_else(|e| panic!("{} does not parse: {e}", path.display()));
        let rel = path.strip_prefix(root).unwrap().display().to_string();
        helpers.in_tests = rel.starts_with("tests/") || rel.contains("/tests/");
        helpers.visit_file(&ast);
        parsed.push((rel, ast));
    }
    let skippers = helpers.closure(|b| b.testkit_skip);
    let mut found = Vec::new();
    let mut tests = 0;
    for (file, ast) in &parsed {
        for (file, test, f) in tests_in(file, ast) {
            tests += 1;
            let mut body = Body::default();
            body.visit_block(&f.block);
            if !body.asserts && !body.calls.iter().any(|c| is_check(c)) {
                found.push((
                    file.clone(),
                    test.clone(),
                    "an assertion",
                    f.sig.span().start().line,
                    "no assertion, and no call of an assert_* or wait_* helper".into(),
                ));
            }
            let mut rules = Rules {
                file,
                test,
                skippers: &skippers,
                announced: Vec::new(),
                in_sync_closure: 0,
                in_spawn: 0,
                in_async_value: 0,
                found: Vec::new(),
            };
            rules.visit_block(&f.block);
            found.extend(rules.found);
        }
    }
    (found, tests)
}

#[test]
fn every_test_asserts_discards_nothing_and_never_returns_silently() {
    let (found, tests) = findings();
    assert!(
        tests > 500,
        "only {tests} tests found: is the reader blind?"
    );
    let mut used = BTreeSet::new();
    let left: Vec<String> = found
        .iter()
        .filter(|(file, test, rule, _, _)| {
            let allowed = ALLOWED
                .iter()
                .position(|(f, t, r, _)| f == file && t == test && r == rule);
            if let Some(i) = allowed {
                used.insert(i);
            }
            allowed.is_none()
        })
        .map(|(file, test, rule, line, detail)| format!("{file}:{line} {test}: {rule}: {detail}"))
        .collect();
    assert!(
        left.is_empty(),
        "{} findings in {tests} tests:\n{}",
        left.len(),
        left.join("\n")
    );
    let stale: Vec<_> = ALLOWED
        .iter()
        .enumerate()
        .filter(|(i, _)| !used.contains(i))
        .map(|(_, a)| a)
        .collect();
    assert!(
        stale.is_empty(),
        "allowed exceptions that no longer occur: {stale:#?}"
    );
}

/// The rules catch what they name, on a file written to break each.
#[test]
fn the_rules_catch_a_test_that_cannot_fail() {
    let code = r#"
        fn checks(x: u32) { assert_eq!(x, 1); }
        fn assert_one(x: u32) { checks(x); }
        fn rig() -> Option<u32> { zattera_testkit::require(&[]).then_some(1) }
        #[test] fn nothing() { let x = 1 + 1; drop(x); }
        #[test] fn through_helper() { checks(1); }
        #[test] fn through_named_helper() { assert_one(1); }
        #[test] fn discards() { let _ = std::fs::write("x", "y"); assert!(true); }
        #[test] fn oks() { std::fs::write("x", "y").ok(); assert!(true); }
        #[test] fn cleans_up() { let _ = std::fs::remove_file("x"); assert!(true); }
        #[tokio::test] async fn blocks() { let v = async { loop { return 1; } }.await; assert_eq!(v, 1); }
        #[tokio::test] async fn rig_body() { on_rig("t", |c| async move { if c { return; } assert!(c); }).await; }
        #[test] fn silent() { if std::env::var("X").is_err() { return; } assert!(true); }
        #[test] fn announced() { let Some(_r) = rig() else { return }; assert!(true); }
        #[tokio::test] async fn closures() { let f = |x: u32| { if x > 1 { return 1; } 0 }; assert_eq!(f(0), 0); }
    "#;
    let ast = syn::parse_file(code).unwrap();
    let mut helpers = Helpers {
        in_tests: true,
        ..Helpers::default()
    };
    helpers.visit_file(&ast);
    let skippers = helpers.closure(|b| b.testkit_skip);
    let mut got = BTreeSet::new();
    for (_, test, f) in tests_in("x.rs", &ast) {
        let mut body = Body::default();
        body.visit_block(&f.block);
        if !body.asserts && !body.calls.iter().any(|c| is_check(c)) {
            got.insert(format!("{test}: an assertion"));
        }
        let mut rules = Rules {
            file: "x.rs".into(),
            test: test.clone(),
            skippers: &skippers,
            announced: Vec::new(),
            in_sync_closure: 0,
            in_spawn: 0,
            in_async_value: 0,
            found: Vec::new(),
        };
        rules.visit_block(&f.block);
        got.extend(
            rules
                .found
                .iter()
                .map(|(_, t, r, _, _)| format!("{t}: {r}")),
        );
    }
    let want: BTreeSet<String> = [
        "nothing: an assertion",
        "through_helper: an assertion",
        "discards: no let _ =",
        "oks: no .ok();",
        "silent: no silent return",
        "rig_body: no silent return",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    assert_eq!(got, want);
}
