//! The node-local time-series store that answers `Stats` (wire.md §1.5
//! "Stats"): a point every 15 s per series, kept 24 h, plus 5-minute
//! averages kept 30 days.
//!
//! A series is `(metric, scope, scope id)`. Points are stored as
//! `(unix seconds: u32, value: f32)`, 8 bytes, so a series holds its day of
//! raw points in 46 KiB.

use std::collections::{BTreeMap, VecDeque};

use crate::proto::v1::{Point, Series, StatsQuery, StatsResponse};

const RAW_KEEP_SECS: u32 = 24 * 3600;
const COARSE_KEEP_SECS: u32 = 30 * 24 * 3600;
const COARSE_STEP_SECS: u32 = 300;
const DEFAULT_RANGE_SECS: i64 = 3600;

/// What a series describes; its label key on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    Node,
    Instance,
    Env,
}

impl Scope {
    fn from_label(label: &str) -> Option<Self> {
        [Scope::Node, Scope::Instance, Scope::Env]
            .into_iter()
            .find(|s| s.label() == label)
    }

    fn label(self) -> &'static str {
        match self {
            Scope::Node => "node",
            Scope::Instance => "instance",
            Scope::Env => "env",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    metric: String,
    scope: Scope,
    id: String,
}

#[derive(Debug, Default)]
struct Points {
    raw: VecDeque<(u32, f32)>,
    coarse: VecDeque<(u32, f32)>,
    /// The 5-minute bucket being filled: start, sum, count.
    bucket: Option<(u32, f64, u32)>,
}

/// The store; one writer (the sampler), readers through a lock.
#[derive(Debug, Default)]
pub struct Store {
    series: BTreeMap<Key, Points>,
}

impl Store {
    /// Records one point; `at` is unix seconds.
    pub fn record(&mut self, at: u32, scope: Scope, id: &str, metric: &str, value: f64) {
        if id.is_empty() {
            return;
        }
        let key = Key {
            metric: metric.to_owned(),
            scope,
            id: id.to_owned(),
        };
        let p = self.series.entry(key).or_default();
        #[allow(clippy::cast_possible_truncation)]
        p.raw.push_back((at, value as f32));
        let start = at - at % COARSE_STEP_SECS;
        match &mut p.bucket {
            Some((s, sum, n)) if *s == start => {
                *sum += value;
                *n += 1;
            }
            slot => {
                if let Some((s, sum, n)) = slot.take() {
                    #[allow(clippy::cast_possible_truncation)]
                    p.coarse.push_back((s, (sum / f64::from(n)) as f32));
                }
                *slot = Some((start, value, 1));
            }
        }
        while p.raw.front().is_some_and(|(t, _)| *t + RAW_KEEP_SECS < at) {
            p.raw.pop_front();
        }
        while p
            .coarse
            .front()
            .is_some_and(|(t, _)| *t + COARSE_KEEP_SECS < at)
        {
            p.coarse.pop_front();
        }
    }

    /// Drops the series of instances no longer sampled (`keep` = live ids)
    /// once they have no point left in either resolution.
    pub fn forget_stale(&mut self, now: u32) {
        self.series.retain(|_, p| {
            p.raw.back().is_some_and(|(t, _)| t + RAW_KEEP_SECS >= now)
                || p.coarse
                    .back()
                    .is_some_and(|(t, _)| t + COARSE_KEEP_SECS >= now)
        });
    }

    /// The newest point of any series, unix seconds.
    pub fn newest(&self) -> Option<u32> {
        self.series
            .values()
            .filter_map(|p| p.raw.back().map(|(t, _)| *t))
            .max()
    }

    /// Drops every series whose newest raw point is older than `keep_secs`
    /// before `now`, or that has none (TS-8's garbage collection).
    pub fn collect_garbage(&mut self, now: u32, keep_secs: u32) {
        self.series
            .retain(|_, p| p.raw.back().is_some_and(|(t, _)| t + keep_secs >= now));
    }

    /// The store as bytes (see [`super::persist`] for the layout).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&super::persist::MAGIC.to_le_bytes());
        out.extend_from_slice(&super::persist::VERSION.to_le_bytes());
        put_len(&mut out, self.series.len());
        for (k, p) in &self.series {
            for text in [k.metric.as_str(), k.scope.label(), k.id.as_str()] {
                put_len(&mut out, text.len());
                out.extend_from_slice(text.as_bytes());
            }
            match p.bucket {
                Some((start, sum, n)) => {
                    out.push(1);
                    out.extend_from_slice(&start.to_le_bytes());
                    out.extend_from_slice(&sum.to_le_bytes());
                    out.extend_from_slice(&n.to_le_bytes());
                }
                None => out.push(0),
            }
            for ring in [&p.raw, &p.coarse] {
                put_len(&mut out, ring.len());
                for (t, v) in ring {
                    out.extend_from_slice(&t.to_le_bytes());
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
        out
    }

    /// The store [`Self::encode`] wrote; an error says what is wrong.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        let mut r = Reader(bytes);
        if r.u32()? != super::persist::MAGIC {
            return Err("bad magic".into());
        }
        let version = r.u32()?;
        if version != super::persist::VERSION {
            return Err(format!(
                "version {version}, not {}",
                super::persist::VERSION
            ));
        }
        let mut store = Store::default();
        for _ in 0..r.u32()? {
            let metric = r.text()?;
            let scope = Scope::from_label(&r.text()?).ok_or("unknown scope")?;
            let id = r.text()?;
            let bucket = match r.take(1)?[0] {
                0 => None,
                1 => Some((r.u32()?, f64::from_le_bytes(r.array()?), r.u32()?)),
                _ => return Err("bad bucket flag".into()),
            };
            let mut rings = [VecDeque::new(), VecDeque::new()];
            for ring in &mut rings {
                let n = r.u32()? as usize;
                if n > r.0.len() / 8 {
                    return Err("ring longer than the file".into());
                }
                for _ in 0..n {
                    ring.push_back((r.u32()?, f32::from_le_bytes(r.array()?)));
                }
            }
            let [raw, coarse] = rings;
            store.series.insert(
                Key { metric, scope, id },
                Points {
                    raw,
                    coarse,
                    bucket,
                },
            );
        }
        if !r.0.is_empty() {
            return Err("trailing bytes".into());
        }
        Ok(store)
    }

    /// Answers a query for node `node_id`; `now` is unix seconds.
    pub fn query(&self, q: &StatsQuery, node_id: &str, now: i64) -> StatsResponse {
        let secs = |t: &Option<prost_types::Timestamp>| t.as_ref().map(|t| t.seconds);
        let until = secs(&q.until).unwrap_or(now);
        let since = secs(&q.since).unwrap_or(until - DEFAULT_RANGE_SECS);
        let coarse = q.step_seconds >= COARSE_STEP_SECS;
        let wanted = |k: &Key| {
            let scoped = if !q.node_id.is_empty() {
                k.scope == Scope::Node && k.id == q.node_id
            } else if !q.environment_id.is_empty() || !q.app_id.is_empty() {
                // Control maps instances to environments and aggregates.
                matches!(k.scope, Scope::Env | Scope::Instance)
            } else {
                k.scope == Scope::Node && k.id == node_id
            };
            scoped && (q.metrics.is_empty() || q.metrics.contains(&k.metric))
        };
        let mut series: Vec<Series> = self
            .series
            .iter()
            .filter(|(k, _)| wanted(k))
            .filter_map(|(k, p)| {
                let mut pts: Vec<(u32, f32)> = if coarse {
                    let mut v: Vec<(u32, f32)> = p.coarse.iter().copied().collect();
                    #[allow(clippy::cast_possible_truncation)]
                    v.extend(p.bucket.map(|(s, sum, n)| (s, (sum / f64::from(n)) as f32)));
                    v
                } else {
                    p.raw.iter().copied().collect()
                };
                pts.retain(|(t, _)| (since..=until).contains(&i64::from(*t)));
                (!pts.is_empty()).then(|| Series {
                    metric: k.metric.clone(),
                    labels: BTreeMap::from([(k.scope.label().to_owned(), k.id.clone())]),
                    points: pts
                        .into_iter()
                        .map(|(t, v)| Point {
                            time_unix_ms: i64::from(t) * 1000,
                            value: f64::from(v),
                        })
                        .collect(),
                })
            })
            .collect();
        // By metric, then scope id (the BTreeMap order is metric, scope, id).
        series.sort_by(|a, b| {
            a.metric
                .cmp(&b.metric)
                .then_with(|| a.labels.values().cmp(b.labels.values()))
        });
        StatsResponse { series }
    }
}

fn put_len(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes());
}

/// Reads little-endian values off the front of a slice.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("truncated".into());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn text(&mut self) -> Result<String, String> {
        let n = self.u32()? as usize;
        if n > super::persist::MAX_STRING {
            return Err(format!("a string of {n} bytes"));
        }
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| "a string that is not UTF-8".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a 5-minute boundary.
    const T0: u32 = 1_800_000_000;

    fn query(f: impl FnOnce(&mut StatsQuery)) -> StatsQuery {
        let mut q = StatsQuery::default();
        f(&mut q);
        q
    }

    fn ts(secs: u32) -> prost_types::Timestamp {
        prost_types::Timestamp {
            seconds: i64::from(secs),
            nanos: 0,
        }
    }

    #[test]
    fn scopes_ranges_and_resolutions() {
        let mut s = Store::default();
        for i in 0..40u32 {
            let at = T0 + i * 15;
            s.record(at, Scope::Node, "n1", "cpu_percent", f64::from(i));
            s.record(at, Scope::Node, "n1", "memory_used_bytes", 1e9);
            s.record(at, Scope::Instance, "a1", "cpu_percent", 50.0);
            s.record(at, Scope::Instance, "a2", "memory_bytes", 2e6);
        }
        let now = i64::from(T0 + 39 * 15);
        // No scope: this node's series, sorted by metric.
        let r = s.query(&StatsQuery::default(), "n1", now);
        let names: Vec<&str> = r.series.iter().map(|x| x.metric.as_str()).collect();
        assert_eq!(names, ["cpu_percent", "memory_used_bytes"]);
        assert_eq!(r.series[0].labels["node"], "n1");
        assert_eq!(r.series[0].points.len(), 40);
        assert_eq!(
            r.series[0].points[0].time_unix_ms,
            i64::from(T0) * 1000,
            "ascending"
        );
        // An environment: instance series; a metric filter.
        let r = s.query(
            &query(|q| {
                q.environment_id = "e1".into();
                q.metrics = vec!["cpu_percent".into()];
            }),
            "n1",
            now,
        );
        assert_eq!(r.series.len(), 1);
        assert_eq!(r.series[0].labels["instance"], "a1");
        // Another node's id: nothing.
        assert!(
            s.query(&query(|q| q.node_id = "n2".into()), "n1", now)
                .series
                .is_empty()
        );
        // A range: since and until are inclusive.
        let r = s.query(
            &query(|q| {
                q.since = Some(ts(T0 + 15));
                q.until = Some(ts(T0 + 45));
            }),
            "n1",
            now,
        );
        assert_eq!(r.series[0].points.len(), 3);
        // 5-minute averages: the first bucket (20 points, 0..=19) averages 9.5.
        let r = s.query(&query(|q| q.step_seconds = 300), "n1", now);
        let cpu = &r.series[0].points;
        assert_eq!(cpu.len(), 2);
        assert!((cpu[0].value - 9.5).abs() < 1e-6, "{cpu:?}");
    }

    #[test]
    fn raw_points_expire_after_a_day() {
        let mut s = Store::default();
        s.record(T0, Scope::Node, "n1", "cpu_percent", 1.0);
        s.record(
            T0 + RAW_KEEP_SECS + 15,
            Scope::Node,
            "n1",
            "cpu_percent",
            2.0,
        );
        let now = i64::from(T0 + RAW_KEEP_SECS + 15);
        let all = query(|q| q.since = Some(ts(0)));
        let r = s.query(&all, "n1", now);
        assert_eq!(r.series[0].points.len(), 1);
        s.record(T0 + COARSE_KEEP_SECS + 600, Scope::Node, "n2", "x", 1.0);
        s.forget_stale(T0 + COARSE_KEEP_SECS + 600);
        assert!(s.query(&all, "n1", now).series.is_empty());
        // Empty ids are not series.
        s.record(T0, Scope::Instance, "", "cpu_percent", 1.0);
        assert!(
            s.query(&query(|q| q.app_id = "x".into()), "n1", now)
                .series
                .is_empty()
        );
    }
}
