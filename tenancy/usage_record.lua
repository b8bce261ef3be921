-- Add usage counts to a tenant's counters, only while the tenant (this epoch of it) exists.
-- KEYS[1] tenant record, KEYS[2] usage hash
-- ARGV[1] "1" to check the tenant (tenant_guard.lua), "0" not to; ARGV[2] epoch; then field, amount pairs
-- Returns 1 when recorded, 0 when the tenant is gone.
if ARGV[1] == '1' and not tenant_alive(KEYS[1], ARGV[2]) then
  return 0
end
for i = 3, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1])
end
return 1
