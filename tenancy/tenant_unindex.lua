-- Remove a deleted tenant's entry from the tenant index (see tenancy/layout.py), only when it is the entry
-- of the record that was deleted: a re-creation under the same id that indexed its own epoch meanwhile
-- keeps its entry.
-- KEYS[1] the tenant index (hash: tenant id -> epoch); ARGV[1] tenant id, ARGV[2] the deleted epoch
-- ("": remove whatever is there, for an entry without a record).
local seen = redis.call('HGET', KEYS[1], ARGV[1])
if seen and (ARGV[2] == '' or seen == ARGV[2]) then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
