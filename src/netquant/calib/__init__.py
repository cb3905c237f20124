"""netquant.calib"""
