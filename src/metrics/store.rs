//! The node-local time-series store that answers `Stats` (wire.md §1.5
//! "Stats"): a point every 15 s per series, kept 24 h, plus 5-minute
//! averages kept 30 days.
//!
//! A series is `(metric, scope, scope id)`. Points are stored as
//! `(unix seconds: u32, value: f32)`, 8 bytes, so a series holds its day of
//! raw points in 46 KiB. Points sit at the start of their 15 s (raw) or
//! 5-minute slot, as the reference's rings put them (TS-3), so the series of
//! several nodes line up when control sums them.

use std::collections::{BTreeMap, VecDeque};

use crate::proto::v1::{Point, Series, StatsQuery, StatsResponse};

/// `tsdb.bin`'s magic and the layout this agent writes.
pub const MAGIC: u32 = 0x5A54_5344;
pub const VERSION: u32 = 2;
/// The reference agent's fixed-ring layout (TS-8): read, never written.
pub const REFERENCE_VERSION: u32 = 1;
/// A string longer than this is corruption.
pub const MAX_STRING: usize = 1 << 20;

const RAW_STEP_SECS: u32 = 15;
/// The reference's ring sizes (TS-3): 24 h of raw slots, 30 days of 5-minute ones.
const RAW_SLOTS: u32 = 5760;
const COARSE_SLOTS: u32 = 8640;
const RAW_KEEP_SECS: u32 = RAW_SLOTS * RAW_STEP_SECS;
const COARSE_STEP_SECS: u32 = 300;
const COARSE_KEEP_SECS: u32 = COARSE_SLOTS * COARSE_STEP_SECS;
const DEFAULT_RANGE_SECS: i64 = 3600;

/// What a series describes; its label key on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    Node,
    Instance,
    Env,
}

impl Scope {
    pub(super) fn from_label(label: &str) -> Option<Self> {
        [Scope::Node, Scope::Instance, Scope::Env]
            .into_iter()
            .find(|s| s.label() == label)
    }

    pub(super) fn label(self) -> &'static str {
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
    /// Records one point; `at` is unix seconds (TS-4). The point goes to
    /// the start of its 15 s slot. A slot older than the newest is dropped;
    /// the same slot again overwrites the raw value, and the 5-minute mean
    /// keeps the slot's first value, as the reference's rings do.
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
        let at = at - at % RAW_STEP_SECS;
        #[allow(clippy::cast_possible_truncation)]
        let value = value as f32;
        match p.raw.back_mut() {
            Some((newest, _)) if at < *newest => return,
            Some((newest, v)) if at == *newest => {
                *v = value;
                return;
            }
            _ => {}
        }
        p.raw.push_back((at, value));
        let start = at - at % COARSE_STEP_SECS;
        match &mut p.bucket {
            Some((s, sum, n)) if *s == start => {
                *sum += f64::from(value);
                *n += 1;
            }
            slot => {
                if let Some((s, sum, n)) = slot.take() {
                    #[allow(clippy::cast_possible_truncation)]
                    p.coarse.push_back((s, (sum / f64::from(n)) as f32));
                }
                *slot = Some((start, f64::from(value), 1));
            }
        }
        // A ring of N slots holds the newest N: the slot N steps back is gone.
        while p.raw.front().is_some_and(|(t, _)| *t + RAW_KEEP_SECS <= at) {
            p.raw.pop_front();
        }
        while p
            .coarse
            .front()
            .is_some_and(|(t, _)| *t + COARSE_KEEP_SECS <= start)
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

    /// The store as bytes (the layout is described in the metrics persist module).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.extend_from_slice(&VERSION.to_le_bytes());
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
        if r.u32()? != MAGIC {
            return Err("bad magic".into());
        }
        let version = r.u32()?;
        if version == REFERENCE_VERSION {
            return Self::decode_reference(r);
        }
        if version != VERSION {
            return Err(format!(
                "version {version}, not {VERSION} (or the reference's {REFERENCE_VERSION})"
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

    /// The reference agent's file after its header (TS-8, version 1): per
    /// series three strings, `i64 cur`, then fixed rings of slot numbers
    /// (-1: empty) and values, raw (5760) and 5-minute (8640, with counts).
    /// Series of a scope this agent does not record are skipped.
    fn decode_reference(mut r: Reader<'_>) -> Result<Self, String> {
        let mut store = Store::default();
        for _ in 0..r.u32()? {
            let metric = r.text()?;
            let scope = r.text()?;
            let id = r.text()?;
            let cur = r.i64()?;
            let raw_slots = r.i64s(RAW_SLOTS as usize)?;
            let raw_values = r.f32s(RAW_SLOTS as usize)?;
            let down_slots = r.i64s(COARSE_SLOTS as usize)?;
            let down_values = r.f32s(COARSE_SLOTS as usize)?;
            let down_counts = r.u16s(COARSE_SLOTS as usize)?;
            let Some(scope) = Scope::from_label(&scope).filter(|_| !id.is_empty()) else {
                continue;
            };
            let at = |slot: i64, step: u32| u32::try_from(slot * i64::from(step)).ok();
            let mut raw: Vec<(u32, f32)> = raw_slots
                .iter()
                .zip(&raw_values)
                .filter(|(slot, _)| **slot >= 0)
                .filter_map(|(slot, v)| Some((at(*slot, RAW_STEP_SECS)?, *v)))
                .collect();
            raw.sort_by_key(|(t, _)| *t);
            // The 5-minute slot `cur` falls in is still filling: it stays open.
            let open = cur.div_euclid(i64::from(COARSE_STEP_SECS / RAW_STEP_SECS));
            let mut coarse = Vec::new();
            let mut bucket = None;
            for ((slot, mean), n) in down_slots.iter().zip(&down_values).zip(&down_counts) {
                let Some(start) = at(*slot, COARSE_STEP_SECS).filter(|_| *slot >= 0) else {
                    continue;
                };
                if *slot == open && *n > 0 {
                    bucket = Some((start, f64::from(*mean) * f64::from(*n), u32::from(*n)));
                } else {
                    coarse.push((start, *mean));
                }
            }
            coarse.sort_by_key(|(t, _)| *t);
            store.series.insert(
                Key { metric, scope, id },
                Points {
                    raw: raw.into(),
                    coarse: coarse.into(),
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
        if until < since {
            return StatsResponse::default();
        }
        // Whole slots, from the one holding `since` to the one holding
        // `until`, at most a ring's worth (TS-6).
        let (step, slots) = if coarse {
            (COARSE_STEP_SECS, COARSE_SLOTS)
        } else {
            (RAW_STEP_SECS, RAW_SLOTS)
        };
        let last = until.div_euclid(i64::from(step));
        let first = since
            .div_euclid(i64::from(step))
            .max(last - i64::from(slots) + 1);
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
                pts.retain(|(t, _)| (first..=last).contains(&(i64::from(*t) / i64::from(step))));
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

    fn i64(&mut self) -> Result<i64, String> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    fn i64s(&mut self, n: usize) -> Result<Vec<i64>, String> {
        let bytes = self.take(n * 8)?;
        Ok(bytes
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect())
    }

    fn f32s(&mut self, n: usize) -> Result<Vec<f32>, String> {
        let bytes = self.take(n * 4)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    fn u16s(&mut self, n: usize) -> Result<Vec<u16>, String> {
        let bytes = self.take(n * 2)?;
        Ok(bytes
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect())
    }

    fn text(&mut self) -> Result<String, String> {
        let n = self.u32()? as usize;
        if n > MAX_STRING {
            return Err(format!("a string of {n} bytes"));
        }
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| "a string that is not UTF-8".into())
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
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

    fn raw_points(s: &Store, since: u32, until: u32) -> Vec<(i64, f64)> {
        let q = query(|q| {
            q.since = Some(ts(since));
            q.until = Some(ts(until));
        });
        s.query(&q, "n1", i64::from(until))
            .series
            .first()
            .map(|x| {
                x.points
                    .iter()
                    .map(|p| (p.time_unix_ms / 1000, p.value))
                    .collect()
            })
            .unwrap_or_default()
    }

    #[test]
    fn points_sit_in_15_second_slots_and_obey_the_slot_rules() {
        let mut s = Store::default();
        // TS-6: four samples round-trip, slot-aligned, exact.
        for i in 0..4u32 {
            s.record(T0 + i * 15 + 7, Scope::Node, "n1", "m", f64::from(i) + 0.5);
        }
        let all = raw_points(&s, T0, T0 + 60);
        assert_eq!(
            all,
            [(0, 0.5), (15, 1.5), (30, 2.5), (45, 3.5)].map(|(d, v)| (i64::from(T0) + d, v))
        );
        // TS-4: the same slot overwrites; an older slot is dropped.
        s.record(T0 + 45 + 14, Scope::Node, "n1", "m", 9.0);
        s.record(T0 + 10, Scope::Node, "n1", "m", 7.0);
        let all = raw_points(&s, T0, T0 + 60);
        assert_eq!(all.len(), 4);
        assert!((all[3].1 - 9.0).abs() < 1e-9);
        assert!((all[0].1 - 0.5).abs() < 1e-9);
        // TS-6: `since` inside slot 1 includes slot 1.
        assert_eq!(raw_points(&s, T0 + 20, T0 + 45).len(), 3);
        // until < since: nothing.
        assert!(raw_points(&s, T0 + 45, T0).is_empty());
    }

    #[test]
    fn a_sub_window_and_a_wrapped_ring() {
        let mut s = Store::default();
        for i in 0..10u32 {
            s.record(T0 + i * 15, Scope::Node, "n1", "m", f64::from(i));
        }
        let window = raw_points(&s, T0 + 3 * 15, T0 + 6 * 15);
        assert_eq!(window.len(), 4);
        assert_eq!(window[0], (i64::from(T0 + 45), 3.0));
        // TS-3: a sample 5760 slots later evicts the old one.
        let mut s = Store::default();
        s.record(T0, Scope::Node, "n1", "m", 1.0);
        s.record(T0 + RAW_KEEP_SECS, Scope::Node, "n1", "m", 2.0);
        assert!(raw_points(&s, T0, T0 + 15).is_empty());
    }

    #[test]
    fn a_five_minute_point_is_the_mean_of_the_first_value_of_each_slot() {
        let mut s = Store::default();
        for i in 0..20u32 {
            s.record(T0 + i * 15, Scope::Node, "n1", "m", f64::from(i + 1));
            // A second write to the same slot changes the raw point only.
            s.record(T0 + i * 15 + 1, Scope::Node, "n1", "m", 1000.0);
        }
        let r = s.query(
            &query(|q| {
                q.step_seconds = 300;
                q.since = Some(ts(T0));
            }),
            "n1",
            i64::from(T0 + 299),
        );
        let p = &r.series[0].points;
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].time_unix_ms, i64::from(T0) * 1000);
        assert!((p[0].value - 10.5).abs() < 0.01, "{p:?}");
    }

    /// One series of the reference's file: metric, scope, id, `cur`, raw
    /// `(slot, value)`s and 5-minute `(slot, mean, count)`s.
    type ReferenceSeries<'a> = (
        &'a str,
        &'a str,
        &'a str,
        i64,
        &'a [(i64, f32)],
        &'a [(i64, f32, u16)],
    );

    /// The reference's file, laid out as TS-8 says.
    fn reference_file(series: &[ReferenceSeries<'_>]) -> Vec<u8> {
        let mut out = Vec::new();
        for v in [0x5A54_5344u32, 1, u32::try_from(series.len()).unwrap()] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for (metric, scope, id, cur, raw, down) in series {
            for text in [metric, scope, id] {
                out.extend_from_slice(&u32::try_from(text.len()).unwrap().to_le_bytes());
                out.extend_from_slice(text.as_bytes());
            }
            out.extend_from_slice(&cur.to_le_bytes());
            let mut slots = vec![-1i64; 5760];
            let mut values = vec![0f32; 5760];
            for (slot, v) in *raw {
                let at = usize::try_from(slot.rem_euclid(5760)).unwrap();
                (slots[at], values[at]) = (*slot, *v);
            }
            for x in &slots {
                out.extend_from_slice(&x.to_le_bytes());
            }
            for x in &values {
                out.extend_from_slice(&x.to_le_bytes());
            }
            let mut slots = vec![-1i64; 8640];
            let mut values = vec![0f32; 8640];
            let mut counts = vec![0u16; 8640];
            for (slot, v, n) in *down {
                let at = usize::try_from(slot.rem_euclid(8640)).unwrap();
                (slots[at], values[at], counts[at]) = (*slot, *v, *n);
            }
            for x in &slots {
                out.extend_from_slice(&x.to_le_bytes());
            }
            for x in &values {
                out.extend_from_slice(&x.to_le_bytes());
            }
            for x in &counts {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        out
    }

    #[test]
    fn the_reference_file_loads_with_its_points_and_open_bucket() {
        let s0 = i64::from(T0 / 15);
        // Raw slots wrap around the ring's end; the last 5-minute slot is open.
        #[allow(clippy::cast_precision_loss)]
        let raw: Vec<(i64, f32)> = (0..25).map(|i| (s0 + i, i as f32)).collect();
        let down = [(s0 / 20, 9.5, 20), (s0 / 20 + 1, 21.0, 5)];
        let bytes = reference_file(&[
            ("cpu_percent", "node", "n1", s0 + 24, &raw, &down),
            ("rps", "app", "x", s0, &[(s0, 1.0)], &[]),
        ]);
        let mut store = Store::decode(&bytes).unwrap();
        assert_eq!(store.series.len(), 1, "the unused app scope is skipped");
        let pts = raw_points(&store, T0, T0 + 24 * 15);
        assert_eq!(pts.len(), 25);
        assert_eq!(pts[24], (i64::from(T0) + 24 * 15, 24.0));
        // The open bucket goes on filling: 5 values of mean 21, then 27.
        store.record(T0 + 25 * 15, Scope::Node, "n1", "cpu_percent", 27.0);
        let r = store.query(
            &query(|q| {
                q.step_seconds = 300;
                q.since = Some(ts(T0));
            }),
            "n1",
            i64::from(T0 + 25 * 15),
        );
        let p = &r.series[0].points;
        assert_eq!(p.len(), 2);
        assert!((p[0].value - 9.5).abs() < 1e-6);
        assert!((p[1].value - 22.0).abs() < 1e-6, "{p:?}");
        // Written back in this agent's own version.
        let again = Store::decode(&store.encode()).unwrap();
        assert_eq!(again.encode(), store.encode());
        // Cut short: an error, not a panic.
        assert!(Store::decode(&bytes[..bytes.len() - 1]).is_err());
    }
}
