-- Settle a finished request in one atomic step: give back (or charge) the difference between what it
-- reserved and what it used, and add its usage counts, only while the tenant (this epoch of it) exists,
-- and at most once per request id (a retried settle whose first try did land is a no-op).
-- tenant_guard.lua and bucket_lib.lua are prepended (see tenancy/layout.py).
--
-- KEYS[1]  the tenant's record (checked when ARGV[2] is "1"; see tenant_guard.lua)
-- KEYS[2]  the tenant's usage hash
-- KEYS[3]  the request's "settled" marker (used when ARGV[5] is not "")
-- KEYS[3+i]  bucket hashes
-- ARGV[1]  now in ms, or "" for the Redis server's clock
-- ARGV[2]  "1": touch nothing unless the tenant record exists with epoch ARGV[3]; "0": no check
-- ARGV[4]  n, the number of buckets
-- ARGV[5]  lifetime of the marker KEYS[3], whole seconds; "" settles without a marker
-- ARGV[3*i+3], ARGV[3*i+4], ARGV[3*i+5]  rate_per_min, capacity, amount added to bucket i (a refund is
--          positive, an overrun charge negative; capped at capacity, floored at minus it)
-- ARGV[6+3n..]  usage field, amount pairs (HINCRBY)
--
-- Returns {1, level_1, ..., level_n} (levels as strings), {-2} when the tenant is gone, or {-3} when the
-- marker says this request was settled already (nothing written in either case).

if ARGV[2] == '1' and not tenant_alive(KEYS[1], ARGV[3]) then
  return {-2}
end
if ARGV[5] ~= '' and not redis.call('SET', KEYS[3], '1', 'NX', 'EX', tonumber(ARGV[5])) then
  return {-3}
end

local n = tonumber(ARGV[4])
local out = {1}
if n > 0 then
  local now = now_ms(ARGV[1])
  for i = 1, n do
    local level = bucket_adjust(KEYS[3 + i], tonumber(ARGV[3 * i + 3]), tonumber(ARGV[3 * i + 4]), now,
      tonumber(ARGV[3 * i + 5]))
    out[1 + i] = string.format('%.17g', level)
  end
end
for j = 6 + 3 * n, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[2], ARGV[j], ARGV[j + 1])
end
return out
