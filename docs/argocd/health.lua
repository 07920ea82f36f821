-- Argo CD health check for serving.kvpilot.dev/LLMDeployment. Install it in argocd-cm as
--   resource.customizations.health.serving.kvpilot.dev_LLMDeployment: |
--     <this file>
-- Healthy once the operator has seen the current generation and Ready is True; Degraded
-- while Degraded is True (a missing Secret or PVC, an invalid spec, a crash-looping engine,
-- a stalled rollout: the message says which); Progressing otherwise.
hs = {}
local generation = obj.metadata and obj.metadata.generation or 0
if obj.status == nil or obj.status.observedGeneration == nil
    or obj.status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "waiting for the kvpilot operator to observe generation " .. tostring(generation)
  return hs
end
local conditions = {}
for _, c in ipairs(obj.status.conditions or {}) do
  conditions[c.type] = c
end
local degraded, ready, progressing = conditions["Degraded"], conditions["Ready"], conditions["Progressing"]
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = (degraded.reason or "") .. ": " .. (degraded.message or "")
elseif ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message or ""
elseif progressing ~= nil and progressing.status == "True" then
  hs.status = "Progressing"
  hs.message = progressing.message or ""
else
  hs.status = "Progressing"
  hs.message = ready ~= nil and (ready.message or "") or "waiting for the first reconcile"
end
return hs
