//! Replays a workload dumped by `bench/peers/dump.py` into one of Dynamo's indexes and
//! measures it the way `bench/peers/kvwire_side.py` measures kvwire's core:
//!
//!     kvwire-bench-peers radix|crtc DUMP ANSWERS
//!
//! prints one JSON object (apply times, raw per-query score samples, RSS) and writes the
//! per-worker matched blocks of every query to ANSWERS, in the format `dump.py` reads.
//! The query timing includes hashing the tokens as Dynamo's router does
//! (`compute_block_hash_for_seq`); the apply timing does not include hashing a block's
//! tokens, which Dynamo's publisher does beside the engine (reported apart).

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::sync::Arc;
use std::time::Instant;

use dynamo_kv_router::indexer::{SyncIndexer, WorkerTask};
use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData,
    KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, OverlapScores, RouterEvent,
};
use dynamo_kv_router::{concurrent_radix_tree_compressed::ConcurrentRadixTreeCompressed, RadixTree};

const MAGIC: &[u8; 8] = b"KVWPEER1";

struct Header {
    block_size: u32,
    blocks_per_event: u32,
    conversations: u64,
    holder_blocks: u64,
    queries: u32,
    query_tokens: u32,
    warmup: u32,
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[i..i + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().unwrap())
}

fn read_header(r: &mut impl Read) -> Header {
    let mut b = [0u8; 8 + 4 * 4 + 8 * 3 + 4 * 3];
    r.read_exact(&mut b).expect("dump header");
    assert_eq!(&b[..8], MAGIC, "not a bench/peers dump");
    Header {
        block_size: u32_at(&b, 8),
        blocks_per_event: u32_at(&b, 12),
        conversations: u64_at(&b, 24),
        holder_blocks: u64_at(&b, 32),
        queries: u32_at(&b, 48),
        query_tokens: u32_at(&b, 52),
        warmup: u32_at(&b, 56),
    }
}

fn read_u32s(r: &mut impl Read, n: usize) -> Vec<u32> {
    let mut b = vec![0u8; n * 4];
    r.read_exact(&mut b).expect("dump body");
    b.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn read_u64s(r: &mut impl Read, n: usize) -> Vec<u64> {
    let mut b = vec![0u8; n * 8];
    r.read_exact(&mut b).expect("dump body");
    b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect()
}

/// On-CPU seconds of a thread (CLOCK_THREAD_CPUTIME_ID or a pthread's CPU clock).
fn cpu_s(clock: libc::clockid_t) -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid clock id and a valid out-pointer.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn rss_anon_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = s.lines().find(|l| l.starts_with("RssAnon:")).expect("RssAnon");
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// One conversation's BlockStored events, as Dynamo's publisher sends them: engine hashes as
/// the block ids, the parent chained from the previous event, content hashes of the tokens.
fn events(h: &Header, worker: u64, hashes: &[u64], tokens: &[u32], event_id: &mut u64) -> Vec<RouterEvent> {
    let local = compute_block_hash_for_seq(tokens, h.block_size, BlockHashOptions::default());
    assert_eq!(local.len(), hashes.len());
    let per = h.blocks_per_event as usize;
    (0..hashes.len())
        .step_by(per)
        .map(|a| {
            let b = (a + per).min(hashes.len());
            *event_id += 1;
            let blocks = (a..b)
                .map(|i| KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(hashes[i]),
                    tokens_hash: local[i],
                    mm_extra_info: None,
                })
                .collect();
            let data = KvCacheStoreData {
                parent_hash: (a > 0).then(|| ExternalSequenceBlockHash(hashes[a - 1])),
                start_position: None,
                blocks,
            };
            RouterEvent::new(
                worker,
                KvCacheEvent { event_id: *event_id, data: KvCacheEventData::Stored(data), dp_rank: 0 },
            )
        })
        .collect()
}

enum Index {
    Radix(RadixTree),
    Crtc {
        tree: Arc<ConcurrentRadixTreeCompressed>,
        tx: flume::Sender<WorkerTask>,
        writer: libc::clockid_t,
        thread: std::thread::JoinHandle<()>,
    },
}

impl Index {
    fn new(kind: &str) -> Index {
        match kind {
            "radix" => Index::Radix(RadixTree::new()),
            "crtc" => {
                // As Dynamo's ThreadPoolIndexer runs it: the writes on their own thread, the reads
                // inline on the caller's. Bounded, so the replay cannot run ahead of the writer.
                let tree = Arc::new(ConcurrentRadixTreeCompressed::new());
                let (tx, rx) = flume::bounded(256);
                let (ctx, crx) = std::sync::mpsc::channel();
                let t = tree.clone();
                let thread = std::thread::spawn(move || {
                    let mut clock: libc::clockid_t = 0;
                    // SAFETY: this thread's own handle and a valid out-pointer.
                    let rc = unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut clock) };
                    assert_eq!(rc, 0, "pthread_getcpuclockid");
                    ctx.send(clock).unwrap();
                    t.worker(rx, None).expect("CRTC writer");
                });
                let writer = crx.recv().unwrap();
                Index::Crtc { tree, tx, writer, thread }
            }
            other => panic!("unknown index {other:?}: radix or crtc"),
        }
    }

    /// Applies the events; returns (on-CPU seconds of the writing thread, wall seconds).
    fn apply(&mut self, evs: Vec<RouterEvent>) -> (f64, f64) {
        match self {
            Index::Radix(t) => {
                let c0 = cpu_s(libc::CLOCK_THREAD_CPUTIME_ID);
                let t0 = Instant::now();
                for e in evs {
                    t.apply_event(e).expect("RadixTree refused a store of kvwire's workload");
                }
                (cpu_s(libc::CLOCK_THREAD_CPUTIME_ID) - c0, t0.elapsed().as_secs_f64())
            }
            Index::Crtc { tx, .. } => {
                for e in evs {
                    tx.send(WorkerTask::Event(e)).expect("CRTC writer gone");
                }
                (0.0, 0.0) // timed as a whole by finish_apply: the writer runs concurrently
            }
        }
    }

    /// Waits until every sent event is applied.
    fn flush(&self) {
        if let Index::Crtc { tx, .. } = self {
            let (s, r) = tokio::sync::oneshot::channel();
            tx.send(WorkerTask::Flush(s)).expect("CRTC writer gone");
            r.blocking_recv().expect("CRTC flush");
        }
    }

    fn writer_cpu_s(&self) -> f64 {
        match self {
            Index::Radix(_) => 0.0,
            Index::Crtc { writer, .. } => cpu_s(*writer),
        }
    }

    fn find(&self, hashes: Vec<LocalBlockHash>) -> OverlapScores {
        match self {
            Index::Radix(t) => t.find_matches(hashes, false),
            Index::Crtc { tree, .. } => tree.find_matches(&hashes, false),
        }
    }

    fn shutdown(self) {
        if let Index::Crtc { tree, tx, thread, .. } = self {
            tx.send(WorkerTask::Terminate).unwrap();
            thread.join().unwrap();
            drop(tree);
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    assert_eq!(args.len(), 4, "usage: kvwire-bench-peers radix|crtc DUMP ANSWERS");
    let (kind, dump, answers) = (&args[1], &args[2], &args[3]);
    let mut r = BufReader::with_capacity(1 << 20, File::open(dump).expect("open dump"));
    let h = read_header(&mut r);
    let bs = h.block_size as usize;

    let rss0 = rss_anon_bytes();
    let mut ix = Index::new(kind);
    let (mut apply_cpu, mut apply_wall, mut hash_cpu) = (0.0, 0.0, 0.0);
    let mut blocks = 0u64;
    let mut event_id = 0u64;
    let writer0 = ix.writer_cpu_s();
    let t_all = Instant::now();
    for _ in 0..h.conversations {
        let head = read_u32s(&mut r, 2);
        let (worker, n) = (head[0] as u64, head[1] as usize);
        let hashes = read_u64s(&mut r, n);
        let tokens = read_u32s(&mut r, n * bs);
        let c0 = cpu_s(libc::CLOCK_THREAD_CPUTIME_ID);
        let evs = events(&h, worker, &hashes, &tokens, &mut event_id);
        hash_cpu += cpu_s(libc::CLOCK_THREAD_CPUTIME_ID) - c0;
        let (c, w) = ix.apply(evs);
        apply_cpu += c;
        apply_wall += w;
        blocks += n as u64;
    }
    ix.flush();
    let all_wall = t_all.elapsed().as_secs_f64();
    if let Index::Crtc { .. } = ix {
        apply_cpu = ix.writer_cpu_s() - writer0;
        apply_wall = all_wall; // send + apply overlap; the writer's clock is the figure
    }
    let rss1 = rss_anon_bytes();

    let qs: Vec<Vec<u32>> = (0..h.queries).map(|_| read_u32s(&mut r, h.query_tokens as usize)).collect();
    let score = |q: &[u32]| {
        let hashes = compute_block_hash_for_seq(q, h.block_size, BlockHashOptions::default());
        ix.find(hashes)
    };
    for q in qs.iter().take(h.warmup as usize) {
        std::hint::black_box(score(q));
    }
    let (mut cpu_us, mut wall_us) = (Vec::new(), Vec::new());
    for q in &qs {
        let c0 = cpu_s(libc::CLOCK_THREAD_CPUTIME_ID);
        let t0 = Instant::now();
        std::hint::black_box(score(q));
        let t1 = t0.elapsed().as_secs_f64();
        cpu_us.push((cpu_s(libc::CLOCK_THREAD_CPUTIME_ID) - c0) * 1e6);
        wall_us.push(t1 * 1e6);
    }

    let mut out = BufWriter::new(File::create(answers).expect("create answers"));
    for q in &qs {
        let mut m: Vec<(u32, u32)> = score(q)
            .scores
            .iter()
            .map(|(w, &b)| {
                assert_eq!(w.dp_rank, 0);
                (w.worker_id as u32, b)
            })
            .collect();
        m.sort_unstable();
        out.write_all(&(m.len() as u32).to_le_bytes()).unwrap();
        for (w, b) in m {
            out.write_all(&w.to_le_bytes()).unwrap();
            out.write_all(&b.to_le_bytes()).unwrap();
        }
    }
    out.flush().unwrap();

    let tree_blocks = match &ix {
        Index::Radix(t) => Some(t.current_size() as u64),
        Index::Crtc { .. } => None,
    };
    let o = serde_json::json!({
        "index": kind,
        "holder_blocks": h.holder_blocks,
        "tree_holder_blocks": tree_blocks,
        "blocks_applied": blocks,
        "apply_cpu_s": apply_cpu,
        "apply_wall_s": apply_wall,
        "publisher_hashing_cpu_s": hash_cpu,
        "rss_anon_growth_bytes": rss1.saturating_sub(rss0),
        "score_cpu_us": cpu_us,
        "score_wall_us": wall_us,
    });
    println!("{o}");
    ix.shutdown();
}
