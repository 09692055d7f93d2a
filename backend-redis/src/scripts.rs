//! The Lua scripts. Each touches exactly one key (`KEYS[1]`), so each runs
//! unchanged on Redis Cluster; each validates the stored record before reading it
//! and answers `IDEMPOTENCY_CORRUPT …` instead of misreading foreign data.
//!
//! Instants arrive as 8 big-endian bytes and are compared as (high, low) 32-bit
//! halves: exact over the whole `u64` range, where Lua's doubles are not. Owner
//! tokens and fingerprints are compared as byte strings, never as numbers.

use redis::Script;

/// Shared helpers, prepended to every script.
const PRELUDE: &str = r#"
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
local v = redis.call('GET', KEYS[1])
if v then
  local problem = bad(v)
  if problem then return redis.error_reply('IDEMPOTENCY_CORRUPT ' .. problem) end
end
"#;

/// `reserve`: ARGV = fresh record (attempt 1, created_at = now), now, lease
/// cutoff (now - skew), retry_failed ('1'/'0'), PX. Answers `{1, attempt}` when
/// the caller now holds the key, `{0, record}` otherwise.
const RESERVE: &str = r#"
local fresh = ARGV[1]
if (not v) or expired(v, ARGV[2]) then
  redis.call('SET', KEYS[1], fresh, 'PX', ARGV[5])
  return {1, 1}
end
if string.byte(v, 55) % 2 == 1 and string.byte(fresh, 55) % 2 == 1
    and string.sub(v, 56, 87) ~= string.sub(fresh, 56, 87) then
  return {0, v}
end
local status = string.sub(v, 2, 2)
local take = false
if status == 'P' then
  local lh, ll = u64(v, 31)
  local ch, cl = u64(ARGV[3], 1)
  take = le(lh, ll, ch, cl)
elseif status == 'F' then
  take = ARGV[4] == '1'
end
if not take then return {0, v} end
local attempt = struct.unpack('>I4', v, 3)
if attempt < 4294967295 then attempt = attempt + 1 end
redis.call('SET', KEYS[1],
  string.sub(fresh, 1, 2) .. struct.pack('>I4', attempt) .. string.sub(v, 7, 14) .. string.sub(fresh, 15),
  'PX', ARGV[5])
return {1, attempt}
"#;

/// `complete` / `fail`: ARGV = owner, now, expires_at, PX, status ('C'/'F'),
/// has value ('1'/'0'), value. Answers 1, or 0 when the lease is lost.
const FINISH: &str = r#"
if (not v) or not owned(v, ARGV[1], ARGV[2]) then return 0 end
local flags = string.byte(v, 55) % 2
local fp = ''
if flags == 1 then fp = string.sub(v, 56, 87) end
local value = ''
if ARGV[6] == '1' then
  value = ARGV[7]
  if ARGV[5] == 'C' then flags = flags + 2 else flags = flags + 4 end
end
redis.call('SET', KEYS[1],
  '\1' .. ARGV[5] .. string.sub(v, 3, 38) .. ARGV[3] .. ARGV[2] .. string.char(flags) .. fp .. value,
  'PX', ARGV[4])
return 1
"#;

/// `release`: ARGV = owner, now. Answers 1, or 0 when the lease is lost.
const RELEASE: &str = r#"
if (not v) or not owned(v, ARGV[1], ARGV[2]) then return 0 end
redis.call('DEL', KEYS[1])
return 1
"#;

/// `extend`: ARGV = owner, now, lease_until. Answers 1, or 0 when the lease is
/// lost. The key's TTL is kept.
const EXTEND: &str = r#"
if (not v) or not owned(v, ARGV[1], ARGV[2]) then return 0 end
redis.call('SET', KEYS[1],
  string.sub(v, 1, 30) .. ARGV[3] .. string.sub(v, 39, 46) .. ARGV[2] .. string.sub(v, 55),
  'KEEPTTL')
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
    /// The script's name: `reserve`, `finish` (complete and fail), `release` or
    /// `extend`.
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

    fn new(name: &'static str, body: &str) -> Self {
        let source = format!("{PRELUDE}{body}");
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
}

impl Scripts {
    pub(crate) fn new() -> Self {
        Scripts {
            reserve: LuaScript::new("reserve", RESERVE),
            finish: LuaScript::new("finish", FINISH),
            release: LuaScript::new("release", RELEASE),
            extend: LuaScript::new("extend", EXTEND),
        }
    }

    pub(crate) fn all(&self) -> [&LuaScript; 4] {
        [&self.reserve, &self.finish, &self.release, &self.extend]
    }
}
