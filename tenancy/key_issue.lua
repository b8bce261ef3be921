-- Store a new API key record for a tenant that exists, atomically (see tenancy/layout.py); every key is in
-- the tenant's slot. The key id's owner entry (P keyid:<key id>, another slot) is written before, by the
-- caller, with SET NX: that is what keeps key ids unique.
-- KEYS[1] tenant record, KEYS[2] key record, KEYS[3] the tenant's key-id set, KEYS[4] its key ids by
-- creation time (sorted set)
-- ARGV[1] key record JSON, ARGV[2] key id, ARGV[3] the record's created_at (unix s)
-- Returns -1 if the tenant does not exist, 0 if the key record exists, 1 when stored.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return -1
end
if not redis.call('SET', KEYS[2], ARGV[1], 'NX') then
  return 0
end
redis.call('SADD', KEYS[3], ARGV[2])
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[2])
return 1
