//! The Lua scripts. Each but `complete_many` touches exactly one key
//! (`KEYS[1]`), so each runs unchanged on Redis Cluster; `complete_many`, many
//! keys at once, runs only on a standalone server. Each validates the stored
//! record before reading it and answers `IDEMPOTENCY_CORRUPT …` (or, for one of
//! `complete_many`'s keys, the problem in that key's place) instead of
//! misreading foreign data.
//!
//! Instants arrive as 8 big-endian bytes and are compared as (high, low) 32-bit
//! halves: exact over the whole `u64` range, where Lua's doubles are not. Owner
//! tokens and fingerprints are compared as byte strings, never as numbers.

use redis::Script;

/// Shared helpers, prepended to every script.
const HELPERS: &str = r#"
local function u64(s, pos)
  local hi, lo = struct.unpack('>I4I4', s, pos)
  return hi, lo
end
local function le(ah, al, bh, bl)
  return ah < bh or (ah == bh and al <= bl)
end
local function bad(v)
  if #v < 55 or string.byte(v, 1) ~= 1 then return 'unsupported record format' end
  local s = string.sub(v, 2, 2)
  if s ~= 'P' and s ~= 'C' and s ~= 'F' then return 'unknown status' end
  if string.byte(v, 55) % 2 == 1 and #v < 87 then return 'truncated fingerprint' end
  return nil
end
local function expired(v, now)
  local eh, el = u64(v, 39)
  local nh, nl = u64(now, 1)
  return le(eh, el, nh, nl)
end
local function owned(v, owner, now)
  return string.sub(v, 2, 2) == 'P' and string.sub(v, 15, 30) == owner and not expired(v, now)
end
local function finish(key, v, status, now, expires, px, add, value)
  local flags = string.byte(v, 55) % 2
  local fp = ''
  if flags == 1 then fp = string.sub(v, 56, 87) end
  flags = flags + tonumber(add)
  redis.call('SET', key,
    '\1' .. status .. string.sub(v, 3, 38) .. expires .. now .. string.char(flags) .. fp .. value,
    'PX', px)
end
"#;

/// Reads and validates `KEYS[1]`'s record into `v`, after [`HELPERS`], in every
/// single-key script.
const READ_ONE: &str = r#"
local v = redis.call('GET', KEYS[1])
if v then
  local problem = bad(v)
  if problem then return redis.error_reply('IDEMPOTENCY_CORRUPT ' .. problem) end
end
"#;

/// `reserve`: ARGV = fresh record (attempt 1, created_at = now, no result,
/// error or retryable flag), now, lease cutoff (now - skew), retry_failed
/// ('1'/'0'), PX. Answers `{1, attempt}` when the caller now holds the key,
/// `{0, record}` otherwise.
///
/// In the order of `decision::reserve_transition`: a missing or logically
/// expired record is replaced; a live `Processing` record whose owner is the
/// fresh record's owner is answered `{1, stored attempt}` without a write (a
/// re-sent reserve); differing fingerprints leave the record; a stale
/// `Processing` record, or a `Failed` one flagged retryable (bit 3) when
/// retry_failed is set, is taken over: the fresh record with `attempt + 1`,
/// the stored `created_at`, and the stored fingerprint when the fresh record
/// has none (no result, error or retryable flag).
const RESERVE: &str = r#"
local fresh = ARGV[1]
if (not v) or expired(v, ARGV[2]) then
  redis.call('SET', KEYS[1], fresh, 'PX', ARGV[5])
  return {1, 1}
end
local status = string.sub(v, 2, 2)
local attempt = struct.unpack('>I4', v, 3)
if status == 'P' and string.sub(v, 15, 30) == string.sub(fresh, 15, 30) then
  return {1, attempt}
end
local stored_fp = string.byte(v, 55) % 2 == 1
local fresh_fp = string.byte(fresh, 55) % 2 == 1
if stored_fp and fresh_fp and string.sub(v, 56, 87) ~= string.sub(fresh, 56, 87) then
  return {0, v}
end
local take = false
if status == 'P' then
  local lh, ll = u64(v, 31)
  local ch, cl = u64(ARGV[3], 1)
  take = le(lh, ll, ch, cl)
elseif status == 'F' then
  take = ARGV[4] == '1' and math.floor(string.byte(v, 55) / 8) % 2 == 1
end
if not take then return {0, v} end
if attempt < 4294967295 then attempt = attempt + 1 end
local tail = string.sub(fresh, 55)
if (not fresh_fp) and stored_fp then tail = '\1' .. string.sub(v, 56, 87) end
redis.call('SET', KEYS[1],
  string.sub(fresh, 1, 2) .. struct.pack('>I4', attempt) .. string.sub(v, 7, 14)
    .. string.sub(fresh, 15, 54) .. tail,
  'PX', ARGV[5])
return {1, attempt}
"#;

/// `complete` / `fail`: ARGV = owner, now, expires_at, PX, status ('C'/'F'),
/// flags to add to the stored fingerprint bit (decimal: result 2 or error 4,
/// plus retryable 8 on a failure), value (empty when none). Answers 1, or 0
/// when the lease is lost.
const FINISH: &str = r#"
if (not v) or not owned(v, ARGV[1], ARGV[2]) then return 0 end
finish(KEYS[1], v, ARGV[5], ARGV[2], ARGV[3], ARGV[4], ARGV[6], ARGV[7])
return 1
"#;

/// `complete` for every key of `KEYS` (a standalone server only: the keys
/// hash to many slots): ARGV = now, then five per key, in `KEYS`' order:
/// owner, expires_at, PX, flags to add (as `finish`'s, for a completion),
/// value. Answers one item per key, as `finish` would for it alone: 1, 0
/// when the lease is lost, or, for a value that is not a record, the problem
/// (a string) — never an error for the whole call, so that one foreign value
/// does not hide which keys were completed.
const COMPLETE_MANY: &str = r#"
local now = ARGV[1]
local out = {}
for i = 1, #KEYS do
  local a = 2 + (i - 1) * 5
  local v = redis.pcall('GET', KEYS[i])
  local answer = 0
  if type(v) == 'table' then
    answer = 'the key holds a value that is not a string'
  elseif v then
    answer = bad(v)
    if not answer then
      answer = 0
      if owned(v, ARGV[a], now) then
        finish(KEYS[i], v, 'C', now, ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4])
        answer = 1
      end
    end
  end
  out[i] = answer
end
return out
"#;

/// `release`: ARGV = owner, now. Answers 1, or 0 when the lease is lost.
const RELEASE: &str = r#"
if (not v) or not owned(v, ARGV[1], ARGV[2]) then return 0 end
redis.call('DEL', KEYS[1])
return 1
"#;

/// `extend`: ARGV = owner, now, lease_until, expires_at, PX (`expires_at -
/// now`). Raises the lease to `max(stored, lease_until)` and the expiry to
/// `max(stored, expires_at)` in one write (an older extension applied after a
/// newer one undoes nothing): when the given expiry is later, the record takes
/// it and the key's TTL becomes PX; otherwise the stored expiry and the key's
/// TTL (which was set from it) are kept, so neither is ever lowered. Answers
/// 1, or 0 when the lease is lost.
const EXTEND: &str = r#"
if (not v) or not owned(v, ARGV[1], ARGV[2]) then return 0 end
local eh, el = u64(v, 39)
local gh, gl = u64(ARGV[4], 1)
local lh, ll = u64(v, 31)
local nh, nl = u64(ARGV[3], 1)
local lease = ARGV[3]
if le(nh, nl, lh, ll) then lease = string.sub(v, 31, 38) end
local head = string.sub(v, 1, 30) .. lease
local tail = ARGV[2] .. string.sub(v, 55)
if le(gh, gl, eh, el) then
  redis.call('SET', KEYS[1], head .. string.sub(v, 39, 46) .. tail, 'KEEPTTL')
else
  redis.call('SET', KEYS[1], head .. ARGV[4] .. tail, 'PX', ARGV[5])
end
return 1
"#;

/// One of the backend's Lua scripts: its name, source and SHA-1 (computed once).
///
/// Exposed so that deployments can review the scripts or preload them with
/// `SCRIPT LOAD` (e.g. when the application's ACL does not allow `SCRIPT`), and so
/// that benchmarks can issue the same commands without the library; see
/// [`RedisRepository::scripts`](crate::RedisRepository::scripts).
#[derive(Debug, Clone)]
pub struct LuaScript {
    pub(crate) name: &'static str,
    pub(crate) source: String,
    pub(crate) sha: String,
}

impl LuaScript {
    /// The script's name: `reserve`, `finish` (complete and fail), `release`,
    /// `extend` or `complete_many` (a batch's completions on a standalone
    /// server).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The full Lua source, as sent with `EVAL` or `SCRIPT LOAD`.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The SHA-1 of the source, in lowercase hex, as used with `EVALSHA`.
    pub fn sha(&self) -> &str {
        &self.sha
    }

    /// A script over `KEYS[1]`, its record read and checked into `v` first.
    fn one_key(name: &'static str, body: &str) -> Self {
        Self::new(name, format!("{HELPERS}{READ_ONE}{body}"))
    }

    fn new(name: &'static str, source: String) -> Self {
        let sha = Script::new(&source).get_hash().to_owned();
        LuaScript { name, source, sha }
    }
}

/// All scripts of the backend.
#[derive(Debug, Clone)]
pub(crate) struct Scripts {
    pub(crate) reserve: LuaScript,
    pub(crate) finish: LuaScript,
    pub(crate) release: LuaScript,
    pub(crate) extend: LuaScript,
    pub(crate) complete_many: LuaScript,
}

impl Scripts {
    pub(crate) fn new() -> Self {
        Scripts {
            reserve: LuaScript::one_key("reserve", RESERVE),
            finish: LuaScript::one_key("finish", FINISH),
            release: LuaScript::one_key("release", RELEASE),
            extend: LuaScript::one_key("extend", EXTEND),
            complete_many: LuaScript::new("complete_many", format!("{HELPERS}{COMPLETE_MANY}")),
        }
    }

    pub(crate) fn all(&self) -> [&LuaScript; 5] {
        [
            &self.reserve,
            &self.finish,
            &self.release,
            &self.extend,
            &self.complete_many,
        ]
    }
}
