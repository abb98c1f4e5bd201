-- Argo CD health check for kascade.io/ScalePlan (resource.customizations.health.kascade.io_ScalePlan).
local hs = {}
if obj.status == nil or obj.status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Pending"
  return hs
end
local phase = obj.status.phase
if phase == "Succeeded" then
  hs.status = "Healthy"
elseif phase == "Failed" then
  hs.status = "Degraded"
else
  hs.status = "Progressing"
end
hs.message = phase
if obj.status.message ~= nil then
  hs.message = phase .. ": " .. obj.status.message
end
return hs
